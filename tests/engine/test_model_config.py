"""ModelConfig reads rope settings in the old and the transformers 5 forms."""

import torch

from framework.config import ModelConfig


def config(**extra):
    return ModelConfig.from_hf_config(
        {"architectures": ["X"], "max_position_embeddings": 4096, **extra}, dtype=torch.float32
    )


def test_rope_settings_in_every_form():
    assert (config().rope_theta, config().rope_scaling) == (10000.0, None)
    old = config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert (old.rope_theta, old.rope_scaling) == (5e5, {"type": "linear", "factor": 2.0, "rope_type": "linear"})
    new = config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    assert (new.rope_theta, new.rope_scaling) == (1e6, {"rope_type": "yarn", "factor": 4.0})
    per_type = config(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert (per_type.rope_theta, per_type.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    plain = config(rope_parameters={"rope_type": "default", "rope_theta": 2e4})
    assert (plain.rope_theta, plain.rope_scaling) == (2e4, None)
