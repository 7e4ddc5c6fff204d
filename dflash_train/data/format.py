"""The training-data format: what dflash-datagen writes and the trainer reads.

One module holds the layout, the manifest, the writer (shards, consolidation) and the reader
(manifest, dataset, target identity check), so that data_gen/ and the trainer agree on it
by construction and the dependency runs one way (data_gen imports this, never the reverse).
Every file is written so that a crash never leaves a half-truth:

    <out>/run.json        settings fingerprint; a restart must match it
    <out>/shards/         shard-NNNNN.parquet, each renamed into place once complete
    <out>/data/           datasets.save_to_disk folder, consolidated from the shards at the end
    <out>/manifest.json   written last: its presence means the output is complete; it holds
                          the sha256 of each file of data/ (``data_sha256``), checked on load

A shard is the unit of work: it holds its rows and the prompts it skipped (in the Parquet
metadata), so a restart skips committed shards and reports the same counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.atomic import atomic_write, atomic_write_text, file_sha256
from dflash_train.errors import check_own_folder

FORMAT_VERSION = 1
COLUMNS = ("input_ids", "loss_mask", "prompt_id", "source", "finish_reason", "prompt_len", "response_len",
           "num_tokens")
SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("prompt_id", pa.string()),
    ("source", pa.string()), ("finish_reason", pa.string()), ("prompt_len", pa.int32()),
    ("response_len", pa.int32()), ("num_tokens", pa.int32()),
])
SHARD_META_KEY = b"dflash_datagen"
CHECKSUMS_KEY = "data_sha256"  # manifest key: {data/ file name: sha256}; absent in older manifests


def shard_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / "shards" / f"shard-{index:05d}.parquet"


def write_shard(out_dir: Path, index: int, rows: list[dict], meta: dict) -> None:
    """Commit one shard: written beside its final name, fsynced, then renamed (atomic)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    table = table.replace_schema_metadata({SHARD_META_KEY: json.dumps(meta).encode()})
    atomic_write(shard_path(out_dir, index), lambda tmp: pq.write_table(table, tmp))


def remove_stale_temps(out_dir: Path) -> None:
    """Drop half-written shards of a killed run (call before any rank starts writing)."""
    for tmp in (Path(out_dir) / "shards").glob(".shard-*.tmp-*"):
        tmp.unlink(missing_ok=True)


def read_shard_meta(out_dir: Path, index: int) -> dict | None:
    """The metadata of a committed shard, or None when it is not committed."""
    path = shard_path(out_dir, index)
    if not path.exists():
        return None
    try:
        return json.loads(pq.read_schema(path).metadata[SHARD_META_KEY])
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"shard {str(path)!r} is damaged ({type(e).__name__}: {e}); delete it and rerun the same "
                         "command to generate it again") from None


# What dflash-datagen writes into out_dir (errors.check_own_folder's patterns): the run's
# fingerprint, shards and their temporary names, what datasets.save_to_disk writes, the manifest.
OWN_FILES = ("run.json", "manifest.json", "budget.json", "shards/", "shards/shard-[0-9][0-9][0-9][0-9][0-9].parquet",
             "shards/.shard-[0-9][0-9][0-9][0-9][0-9].parquet.tmp-*", "data/", "data/state.json",
             "data/dataset_info.json", "data/data-[0-9]*-of-[0-9]*.arrow",
             # prompts written by the target (data_gen/magpie.py), kept for a restart
             "prompts/", "prompts/*/", "prompts/*/settings.json", "prompts/*/closed.json",
             "prompts/*/candidates-[0-9]*.jsonl", "prompts/*/.*.tmp-*")


def _recorded(out: Path) -> bool:
    # run.json is written before anything else: without it (or the manifest) the files,
    # a data/ folder above all, are not from a run of ours.
    # A run killed while the target wrote its prompts has only them, beside their settings.
    return (out / "run.json").is_file() or (out / "manifest.json").is_file() or \
        any((out / "prompts").glob("*/settings.json"))


def check_out_dir(out_dir) -> None:
    """Raise ValueError unless ``out_dir`` is absent, empty or a dflash-datagen output.

    A run replaces ``data/`` when it consolidates: that folder, and the rest of out_dir,
    must be our own output, never a user's files that happen to sit there.
    """
    check_own_folder(out_dir, "out_dir", "dflash-datagen", OWN_FILES, _recorded)


def check_run(out_dir: Path, fingerprint: dict) -> None:
    """Record the run's settings, or check that a restart uses the same ones."""
    path = Path(out_dir) / "run.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(fingerprint, indent=2, sort_keys=True))
        return
    previous = json.loads(path.read_text())
    for key in sorted(set(previous) | set(fingerprint)):
        if previous.get(key) != fingerprint.get(key):
            raise ValueError(f"out_dir {str(out_dir)!r} holds a run with {key}={previous.get(key)!r}, this one has "
                             f"{key}={fingerprint.get(key)!r}: use a new out_dir or the original settings")


def consolidate(out_dir: Path, shards: Iterable[int], manifest: dict) -> None:
    """Join the committed shards of these indices (all of a run's, or those a budget let it
    begin) in order into <out>/data, then write the manifest."""
    import datasets

    out_dir = Path(out_dir)
    tables = [_read_shard(shard_path(out_dir, i)) for i in sorted(shards)]
    table = pa.concat_tables(tables).replace_schema_metadata(None)

    def write(tmp: Path) -> None:
        datasets.Dataset(table).save_to_disk(str(tmp))
        check_out_dir(out_dir)  # again right before data/ is replaced: it must be ours

    atomic_write(out_dir / "data", write, folder=True)
    manifest = {**manifest, CHECKSUMS_KEY: data_checksums(out_dir / "data")}
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))


def data_checksums(data_dir: Path) -> dict[str, str]:
    """{file name: sha256} of every file of a data/ folder."""
    return {p.name: file_sha256(p) for p in sorted(Path(data_dir).iterdir()) if p.is_file()}


def _read_shard(path: Path) -> pa.Table:
    try:
        return pq.read_table(path, memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"shard {str(path)!r} is damaged ({type(e).__name__}: {e}); delete it and rerun the same "
                         "command to generate it again") from None


def read_manifest(out_dir) -> dict:
    path = Path(out_dir) / "manifest.json"
    if not path.exists():
        what = "an unfinished dflash-datagen run (rerun the same command to finish it)" \
            if (Path(out_dir) / "run.json").exists() else "not a dflash-datagen output"
        raise ValueError(f"{str(out_dir)!r} has no manifest.json: {what}")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r}: format_version={manifest.get('format_version')!r}, "
                         f"this code reads {FORMAT_VERSION}")
    return manifest


def load_generated(out_dir):
    """The generated dataset of a finished run (a datasets.Dataset with COLUMNS)."""
    import datasets

    manifest = read_manifest(out_dir)
    data_dir = Path(out_dir) / "data"
    if not data_dir.is_dir():
        raise ValueError(f"{str(out_dir)!r} has a manifest but no data/ folder: the output is damaged")
    if not manifest.get("counts", {}).get("rows"):
        raise ValueError(f"{str(out_dir)!r} is an empty dataset (its manifest counts 0 rows): nothing to train on")
    for name, digest in manifest.get(CHECKSUMS_KEY, {}).items():
        file = data_dir / name
        if not file.is_file() or file_sha256(file) != digest:
            raise ValueError(f"{str(file)!r} is {'missing' if not file.is_file() else 'damaged'} (its sha256 does "
                             "not match manifest.json); regenerate it (remove manifest.json and data/ and rerun "
                             "dflash-datagen)")
    try:
        data = datasets.load_from_disk(str(data_dir))
    except (pa.ArrowException, OSError, IndexError, KeyError, ValueError) as e:
        # A truncated or damaged Arrow file: pyarrow's message does not say which one.
        raise ValueError(f"{str(data_dir)!r}: unreadable dataset, truncated or damaged ({type(e).__name__}: {e}); "
                         "regenerate it (remove manifest.json and data/ and rerun dflash-datagen)") from None
    missing = [c for c in COLUMNS if c not in data.column_names]
    if missing or len(data) != manifest["counts"]["rows"]:
        raise ValueError(f"{str(data_dir)!r}: columns {data.column_names} / {len(data)} rows do not match the "
                         f"manifest ({manifest['counts']['rows']} rows, missing columns {missing})")
    return data


def check_rows(ds, vocab_size: int, where) -> None:
    """Refuse rows a trainer cannot use, before the first step: token ids outside the
    target's vocabulary, loss masks of another length than their ids or with values other
    than 0 and 1, length columns that disagree with the ids. Raises ValueError naming the
    first bad row. Read from the Arrow columns a chunk at a time (min/max in Arrow's own
    kernels), without decoding rows."""
    import numpy as np
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    ids, mask = table.column("input_ids"), table.column("loss_mask")
    _check_values(ids, 0, vocab_size - 1, lambda row, v: (
        f"{where}: row {row} holds token id {v}, outside the target's vocabulary of {vocab_size} "
        f"(0..{vocab_size - 1}): the data is damaged or made for another target"))
    _check_values(mask, 0, 1, lambda row, v: (
        f"{where}: row {row} has loss_mask value {v} (only 0 and 1 are valid): the data is damaged"))
    lengths = pc.list_value_length(ids).to_numpy()
    columns = {"loss_mask length": pc.list_value_length(mask).to_numpy(),
               "num_tokens": table.column("num_tokens").to_numpy(),
               "prompt_len + response_len": (table.column("prompt_len").to_numpy()
                                             + table.column("response_len").to_numpy())}
    for name, column in columns.items():
        wrong = np.flatnonzero(column != lengths)
        if wrong.size:
            row = int(wrong[0])
            raise ValueError(f"{where}: row {row} has {name} {int(column[row])} but {int(lengths[row])} token ids: "
                             "the data is damaged")


def _check_values(column, low: int, high: int, message) -> None:
    """Raise ValueError(message(row, value)) for the first value of a list column outside [low, high]."""
    import numpy as np
    import pyarrow.compute as pc

    first_row = 0
    for chunk in column.chunks:
        values = chunk.flatten()
        bounds = pc.min_max(values).as_py()
        if len(values) and (bounds["min"] < low or bounds["max"] > high):
            array = values.to_numpy()
            at = int(np.flatnonzero((array < low) | (array > high))[0])
            row = first_row + int(pc.list_parent_indices(chunk)[at].as_py())
            raise ValueError(message(row, int(array[at])))
        first_row += len(chunk)


def check_target(manifest: dict, identity: dict, tokenizer: dict, tokenizer_hash: str | None = None) -> None:
    """Refuse data generated with other target weights or another tokenizer than this target's.

    Compared by content, never by name: the same weights under another path or hub id are
    the same target. ``identity`` is a target_identity, ``tokenizer`` a tokenizer_identity;
    ``tokenizer_hash`` (the older single hash) is read only for manifests that lack the
    tokenizer fields.
    """
    target = manifest.get("target") or {}
    if "weights" in target:
        pairs = [("target.weights", target["weights"], identity.get("weights"))]
    else:  # manifests before content digests: their revision (GGUF digest, config hash)
        pairs = [("target.revision", target.get("revision"), identity.get("revision"))]
    recorded = manifest.get("tokenizer")
    if recorded is not None:
        pairs += [(f"tokenizer.{key}", recorded.get(key), tokenizer[key])
                  for key in ("vocab_sha256", "chat_template_sha256")]
    elif manifest.get("tokenizer_hash") != tokenizer_hash:
        # An older manifest's hash depends on the transformers version that read the
        # tokenizer. For a GGUF target the vocabulary is inside the file whose digest was
        # compared above, and the template actually used is recorded beside: same file and
        # same template are the same labels.
        template = (manifest.get("template") or {}).get("chat_template_sha256")
        gguf = str(identity.get("weights", "")).startswith("gguf-")
        if not (gguf and template == tokenizer["chat_template_sha256"]):
            pairs.append(("tokenizer_hash", manifest.get("tokenizer_hash"), tokenizer_hash))
    for key, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"the data was generated with {key}={theirs!r} but the target has {key}={ours!r}: "
                             "regenerate the data for this target (data.check_manifest=false skips this check)")
