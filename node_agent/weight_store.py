"""Host weight store: the full model placed once per host in shared memory (engine-agnostic).

Workers load their shard from it on every switch (RELOAD_SHARDS) through the ``remp_shm`` model
loader: no disk I/O, no download, only a safetensors header read and memory copies.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from remp.errors import ConfigError


@dataclass
class WeightStore:
    path: Path
    nbytes: int

    @classmethod
    def create(cls, model_dir: Path, root: Path, name: str) -> "WeightStore":
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"the weight store needs safetensors files in {model_dir}")
        need = sum(f.stat().st_size for f in files)
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        if need > free:
            raise ConfigError(f"weight store needs {need} bytes in {root}, only {free} free")
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, path / f.name)
        return cls(path, need)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
