"""Each command recognises another command's run folder and says whose it is, and a folder
that is not ours is refused with every name in it counted."""

import json

import pytest

from dflash_train import quality
from dflash_train.data.format import check_out_dir
from dflash_train.errors import check_own_folder, folder_writer
from dflash_train.training.run_dir import check_output_dir, mark_output_dir


def test_quality_and_datagen_name_a_training_folder(tmp_path):
    mark_output_dir(tmp_path)  # dflash-train's run.json
    run = quality.load(["target=smollm2_135m", "data.path=d", "budget_min=1", f"run_dir={tmp_path}"])
    with pytest.raises(ValueError, match=rf"^run_dir '{tmp_path}' holds a dflash-train run, not a dflash-quality "
                                         "one: it is left untouched; choose an empty or new folder$"):
        quality.check_run(run, tmp_path)
    with pytest.raises(ValueError, match=rf"^out_dir '{tmp_path}' holds a dflash-train run, not a dflash-datagen one"):
        check_out_dir(tmp_path)


def test_training_names_a_datagen_or_quality_folder(tmp_path):
    datagen = tmp_path / "data"
    datagen.mkdir()
    (datagen / "run.json").write_text(json.dumps({"target": {}, "tokenizer": {}, "template": {}, "sampling": {},
                                                  "prompts_sha256": "ab", "backend": "hf"}))
    assert folder_writer(datagen) == "dflash-datagen"
    with pytest.raises(ValueError, match="holds a dflash-datagen run, not a dflash-train one"):
        check_output_dir(datagen)
    runs = tmp_path / "quality"
    runs.mkdir()
    (runs / "run.json").write_text(json.dumps({"written_by": "dflash-quality", "settings": {}}))
    with pytest.raises(ValueError, match="holds a dflash-quality run, not a dflash-train one"):
        check_output_dir(runs)


def test_a_folder_not_ours_lists_every_name_in_it(tmp_path):
    for name in ("data_manifest.json", "metrics.jsonl", "notes.txt", "a.txt"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError) as err:
        check_output_dir(tmp_path, ("data_manifest.json",))
    assert str(err.value) == (f"output_dir '{tmp_path}' holds files dflash-train did not write (a.txt, "
                              "notes.txt, data_manifest.json and 1 more); they are left untouched: choose an "
                              "empty or new folder")
    with pytest.raises(ValueError, match=r"^run_dir .* \(notes.txt\)"):  # the caller's own key
        check_own_folder(tmp_path, "run_dir", "dflash-train", ("a.txt", "data_manifest.json", "metrics.jsonl"))


def test_eval_results_that_are_not_json_are_named_with_their_key(tmp_path):
    from dflash_train.eval.report import results_table

    bad = tmp_path / "results.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match=rf"^eval_results='{bad}' is not a results.json of dflash-eval \(Expecting"):
        results_table(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"^hub.eval_results=.* is not a results.json of dflash-eval \(missing "
                                         r"'datasets'\)$"):
        results_table(bad, "hub.eval_results")


def test_another_ranks_write_probe_is_ours(tmp_path):
    """Two ranks of one dflash-datagen check its out_dir at once: rank 0's write probe
    (errors.check_writable_dir) sat in the folder when rank 1 looked, and rank 1 refused it as
    a file dflash-datagen did not write (seen in test_datagen_torchrun)."""
    from dflash_train.errors import WRITE_PROBE

    (tmp_path / f"{WRITE_PROBE}k3j9x1").write_text("")
    check_out_dir(tmp_path)  # the folder holds nothing else: no run.json, no proof needed
    check_output_dir(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"did not write \(notes.txt\)"):
        check_out_dir(tmp_path)
