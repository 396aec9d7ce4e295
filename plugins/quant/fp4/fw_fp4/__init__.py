"""fw plugin: MXFP4 (e2m1 values, an e8m0 scale per 32) checkpoints served as W4A16."""
