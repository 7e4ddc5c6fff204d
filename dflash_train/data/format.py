"""The training-data format: what dflash-datagen writes and the trainer reads.

One module holds the layout, the manifest, the writer (shards, consolidation) and the reader
(manifest, dataset, target identity check), so that data_gen/ and the trainer agree on it
by construction and the dependency runs one way (data_gen imports this, never the reverse).
Every file is written so that a crash never leaves a half-truth:

    <out>/run.json        settings fingerprint; a restart must match it
    <out>/shards/         shard-NNNNN.parquet, each renamed into place once complete
    <out>/data/           datasets.save_to_disk folder, consolidated from the shards at the end
    <out>/manifest.json   written last: its presence means the output is complete

A shard is the unit of work: it holds its rows and the prompts it skipped (in the Parquet
metadata), so a restart skips committed shards and reports the same counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.atomic import atomic_write, atomic_write_text

FORMAT_VERSION = 1
COLUMNS = ("input_ids", "loss_mask", "prompt_id", "source", "finish_reason", "prompt_len", "response_len",
           "num_tokens")
SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("prompt_id", pa.string()),
    ("source", pa.string()), ("finish_reason", pa.string()), ("prompt_len", pa.int32()),
    ("response_len", pa.int32()), ("num_tokens", pa.int32()),
])
SHARD_META_KEY = b"dflash_datagen"


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


def _foreign(folder: Path, own) -> list[str]:
    """Names in ``folder`` that none of our writers produce (``own(name)`` says which do)."""
    return sorted(p.name for p in folder.iterdir() if not own(p.name))


def _own_top(name: str) -> bool:
    # Besides the outputs: the temporary names of dflash_train.atomic (and the replaced
    # data folder it steps aside while renaming).
    return name in ("run.json", "manifest.json", "shards", "data") or re.fullmatch(r"\.[\w.]+\.(tmp-\w+|old)", name)


def _own_shard(name: str) -> bool:
    return re.fullmatch(r"\.?shard-\d{5}\.parquet(\.tmp-\d+)?", name) is not None


def _own_data(name: str) -> bool:
    # What datasets.save_to_disk writes.
    return name in ("state.json", "dataset_info.json") or re.fullmatch(r"data-\d+-of-\d+\.arrow", name) is not None


def check_out_dir(out_dir) -> None:
    """Raise ValueError unless ``out_dir`` is absent, empty or a dflash-datagen output.

    A run replaces ``data/`` when it consolidates: that folder, and the rest of out_dir,
    must be our own output, never a user's files that happen to sit there.
    """
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a folder")
    foreign = _foreign(out, _own_top)
    for sub, own in (("shards", _own_shard), ("data", _own_data)):
        if (out / sub).exists():
            if not (out / sub).is_dir():
                foreign.append(sub)
            else:
                foreign += [f"{sub}/{name}" for name in _foreign(out / sub, own)]
    recorded = (out / "run.json").is_file() or (out / "manifest.json").is_file()
    if (out / "data").is_dir() and not recorded:  # a dataset folder of the user's, not from a run of ours
        foreign.append("data (no run.json or manifest.json beside it)")
    if foreign:
        raise ValueError(f"out_dir {str(out)!r} holds files that are not dflash-datagen output ({foreign[:3]}); "
                         "they are left untouched: choose an empty or new out_dir")


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


def consolidate(out_dir: Path, num_shards: int, manifest: dict) -> None:
    """Join the committed shards in order into <out>/data, then write the manifest."""
    import datasets

    out_dir = Path(out_dir)
    tables = [_read_shard(shard_path(out_dir, i)) for i in range(num_shards)]
    table = pa.concat_tables(tables).replace_schema_metadata(None)

    def write(tmp: Path) -> None:
        datasets.Dataset(table).save_to_disk(str(tmp))
        check_out_dir(out_dir)  # again right before data/ is replaced: it must be ours

    atomic_write(out_dir / "data", write, folder=True)
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))


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
