"""Where a grid's relative paths point: `hf:` configs and cluster profiles are taken from the
grid's folder, whatever the working folder, so launch files and reruns read the same files."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdp_bench.config.model import HF_PREFIX
from fsdp_bench.errors import ConfigError


def paths_from(data: Any, folder: Path) -> Any:
    """The grid with each relative `hf:` path in `model.name` (base, axes, exclude) made
    absolute from `folder`: what launch files and other working folders read the same."""
    if not isinstance(data, Mapping):
        return data

    def absolute(value: Any) -> Any:
        if isinstance(value, list):
            return [absolute(v) for v in value]
        if isinstance(value, str) and value.startswith(HF_PREFIX):
            given = Path(value[len(HF_PREFIX) :]).expanduser()
            return value if given.is_absolute() else f"{HF_PREFIX}{folder / given}"
        return value

    def in_mapping(section: Any) -> Any:
        if not isinstance(section, Mapping):
            return section
        out = {k: absolute(v) if k == "model.name" else v for k, v in section.items()}
        model = out.get("model")
        if isinstance(model, Mapping) and "name" in model:
            out["model"] = {**model, "name": absolute(model["name"])}
        return out

    out = dict(data)
    for key in ("base", "axes", "exclude"):
        section = out.get(key)
        if isinstance(section, list):
            out[key] = [in_mapping(s) for s in section]
        elif section is not None:
            out[key] = in_mapping(section)
    return out


def find_cluster_profile(name: str, grid_dir: Path) -> Path:
    """slurm/clusters/<name>.yaml under the working directory or the grid's project; or a path."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        candidates = [grid_dir / name]
    else:
        relative = Path("slurm", "clusters", f"{name}.yaml")
        candidates = [Path.cwd() / relative, grid_dir.parent / relative, grid_dir / relative]
    for path in candidates:
        if path.is_file():
            return path
    folders = {c.parent for c in candidates if c.parent.is_dir() and c.parent.name == "clusters"}
    known = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
    raise ConfigError(
        f"launcher.cluster: no profile {name!r} (looked for {', '.join(map(str, candidates))}); "
        f"available: {', '.join(known) or 'none'}"
    )
