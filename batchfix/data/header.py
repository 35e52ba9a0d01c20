"""The input before it is read: its path (null = the bundled dataset) and what its header holds (obs columns,
layers), read with h5py alone, so that every option naming one of them is checked before any work: a misspelt
column fails in a second, not after the imports and the read."""
from __future__ import annotations

from pathlib import Path

from batchfix.errors import InputError

BUNDLED_FILE = "cellbench5.h5ad"


def bundled_dataset() -> str:
    """Path of the bundled CellBench dataset (the default input of every command)."""
    from importlib import resources

    return str(resources.files("batchfix.bundled").joinpath(BUNDLED_FILE))


def input_path(path: str | None) -> str:
    """A user's input path, or the bundled dataset for null / 'bundled'."""
    return bundled_dataset() if path in (None, "", "bundled") else str(Path(path).expanduser())


def missing_obs_column(key: str, columns: list, what: str, option: str, hint: str = "") -> InputError:
    return InputError(
        f"{what} key '{key}' is not an obs column. Columns present: "
        f"{list(map(str, columns)) or '(none)'}. Set it with {option}=<column>{hint}."
    )


def missing_matrix(layer: str | None, present: list[str], option: str = "data.counts_layer") -> InputError:
    """The error for X or a layer that is not there, naming the layers that are."""
    if layer is None:
        return InputError(f"The file has no X matrix. Layers present: {present or '(none)'}; set {option}.")
    return InputError(f"Layer '{layer}' not found. Layers present: {present or '(none)'}. "
                      f"Use {option}=null to read X.")


def header(path: str | Path) -> tuple[list[str], list[str]] | None:
    """(obs columns, layer names) of an .h5ad, or None when h5py cannot read them (the full read then reports)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            order = f["obs"].attrs.get("column-order", [])
            columns = [c.decode() if isinstance(c, bytes) else str(c) for c in order]
            layers = list(f["layers"].keys()) if "layers" in f else []
    except (OSError, KeyError, TypeError, AttributeError):
        return None
    return columns, layers


def check_named_keys(path: str | Path, obs: dict[str, tuple[str, str | None]],
                     layers: dict[str, str | None]) -> None:
    """Refuse an option naming an obs column (obs: option -> (what, column)) or a layer (layers: option -> layer)
    that the file at `path` does not have; null options are not checked."""
    found = header(path)
    if found is None:
        return
    columns, present = found
    for option, (what, key) in obs.items():
        if key is not None and key not in columns:
            hint = "; data.label_key=null works without labels" if option == "data.label_key" else ""
            raise missing_obs_column(key, columns, what, option, hint)
    for option, layer in layers.items():
        if layer is not None and layer not in present:
            raise missing_matrix(layer, present, option)
