"""Reading a YAML file (a grid, a cluster profile) strictly: UTF-8 only, no key twice, and
every way it can fail told in one line naming the file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fsdp_bench.errors import ConfigError, one_line


def read_yaml(path: Path) -> Any:
    """The file's data; a `ConfigError` naming the file when it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: {_not_utf8(err)}") from None
    import yaml  # here, not at import: the worker imports this package and must stay light

    try:
        return yaml.load(text, Loader=_strict_loader())
    except yaml.reader.ReaderError as err:  # a NUL or control character; YAML names no line
        line = text.count("\n", 0, err.position) + 1
        column = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        raise ConfigError(
            f"{path}: not valid YAML: character #x{err.character:04x} at line {line}, "
            f"column {column}: control characters are not allowed"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {one_line(err)}") from None


def _not_utf8(err: UnicodeDecodeError) -> str:
    """What is wrong with a file that does not decode (an image, UTF-16, random bytes)."""
    data = err.object
    hint = "; it is UTF-16: save it as UTF-8" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    return f"not a text file in UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}){hint}"


@functools.cache
def _strict_loader() -> type:
    """SafeLoader that rejects a key given twice in one mapping (YAML silently keeps the last)."""
    import yaml

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return loader.construct_mapping(node)

    class StrictLoader(yaml.SafeLoader):
        pass

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader
