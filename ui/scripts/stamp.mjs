// Records the hash of the UI sources in the bundle (SOURCE_HASH). The Python test
// (tests/server/test_webui_bundle.py) recomputes it without Node and fails when the
// committed bundle is stale. Same algorithm as framework.server.webui.source_hash.
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join, relative, sep } from 'node:path';
import { fileURLToPath } from 'node:url';

const uiDir = fileURLToPath(new URL('..', import.meta.url));
const outFile = fileURLToPath(new URL('../../framework/server/webui/static/SOURCE_HASH', import.meta.url));

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    if (dir === uiDir.replace(/[\\/]$/, '') && (name === 'node_modules' || name === 'dist')) return [];
    return statSync(path).isDirectory() ? walk(path) : [path];
  });
}

const root = uiDir.replace(/[\\/]$/, '');
const files = walk(root).map((path) => relative(root, path).split(sep).join('/'));
files.sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
const hash = createHash('sha256');
for (const file of files) {
  hash.update(Buffer.concat([Buffer.from(file), Buffer.from([0])]));
  hash.update(Buffer.concat([readFileSync(join(root, file)), Buffer.from([0])]));
}
writeFileSync(outFile, hash.digest('hex') + '\n');
console.log(`stamped ${files.length} source files into ${outFile}`);
