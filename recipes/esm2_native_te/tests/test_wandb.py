"""Weights & Biases through a real wandb in offline mode: the run holds what the training script logged, and a job
resumed from a checkpoint continues the same W&B run.

wandb writes an offline run to ``<output_dir>/wandb/offline-run-*/run-<id>.wandb``: a LevelDB-style log (a 7-byte
file header ``:W&B``, magic, version; then 32 KiB blocks of records, each behind a 7-byte header of CRC-32, length and
type full/first/middle/last) of wandb's protobuf ``Record`` messages, read here with the protobuf classes of the
installed wandb (the version requirements.txt pins).
"""

import json
import struct
from pathlib import Path

import pytest
from launch import run_script
from test_train import FAST, TINY_MODEL, read_metrics


wandb_records = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb is not installed")

BLOCK_BYTES, HEADER_BYTES = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
OFFLINE = [TINY_MODEL, *FAST, "logger.log_every=10", "wandb.mode=offline", "dataset.num_workers=0"]


def read_records(path: Path) -> list:
    """The protobuf records of one offline run file, in the order written."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    chunks, pending, position = [], b"", HEADER_BYTES
    while position + HEADER_BYTES <= len(data):
        room = BLOCK_BYTES - position % BLOCK_BYTES
        if room < HEADER_BYTES:  # a block's tail too short for a record header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER_BYTES])
        assert kind in (FULL, FIRST, MIDDLE, LAST), (path, position, kind)
        chunk = data[position + HEADER_BYTES : position + HEADER_BYTES + length]
        position += HEADER_BYTES + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            chunks.append(pending)
    records = []
    for chunk in chunks:
        record = wandb_records.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def as_dict(items) -> dict:
    """A record's key/value items (a key may come as a path of nested keys: "_wandb/runtime")."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_offline_run(path: Path) -> dict:
    """The run's id, project, name and config, its history rows and its summary (the updates merged)."""
    run = {"history": [], "summary": {}}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            run["config"] = as_dict(record.run.config.update)
        elif kind == "history":
            run["history"].append(as_dict(record.history.item))
        elif kind == "summary":
            run["summary"].update(as_dict(record.summary.update))
    return run


def offline_runs(output_dir: Path) -> list[dict]:
    """Every offline run under ``output_dir``, in the order of the steps they logged."""
    runs = [read_offline_run(path) for path in (output_dir / "wandb").glob("offline-run-*/run-*.wandb")]
    return sorted(runs, key=lambda run: run["history"][0]["_step"])


def test_the_offline_run_holds_the_metrics_validation_and_summary_the_run_wrote(tmp_path):
    """Two DDP processes: one W&B run (rank 0's), with the resolved config, every logged window's metrics at its
    step, the held-out loss and perplexity at the validation steps, and summary.json's values."""
    validate = ["validation.every_n_steps=20"]
    run_script("train_ddp.py", f"output_dir={tmp_path}", *OFFLINE, *validate, "num_train_steps=40", nproc=2)
    (run,) = offline_runs(tmp_path)
    assert run["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert (run["project"], run["name"]) == ("esm2_native_te", "L0_sanity")
    assert run["config"]["num_train_steps"] == 40 and run["config"]["wandb"]["mode"] == "offline"

    history = {row["_step"]: row for row in run["history"]}
    metrics = read_metrics(tmp_path)
    assert sorted(history) == [m["step"] for m in metrics] == [10, 20, 30, 40]
    for logged in metrics:
        for key in ("loss", "perplexity", "grad_norm", "lr", "tokens_per_second_per_gpu"):
            assert history[logged["step"]][key] == logged[key], (logged["step"], key)
    held_out = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in held_out] == [20, 40]
    for record in held_out:
        row = history[record["step"]]
        assert (row["val_loss"], row["val_perplexity"]) == (record["val_loss"], record["val_perplexity"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {key: run["summary"][key] for key in summary} == summary


def test_a_resumed_job_continues_the_wandb_run_and_a_fresh_start_begins_another(tmp_path):
    """20 steps, then the same command to 40 resumes from the step-20 checkpoint and logs into the same W&B run: the
    two jobs' rows are the 40-step run's metrics.jsonl. A job that starts from step 0 (checkpoint.resume=false, with
    checkpoints of its own: it refuses to start over another run's) starts a new W&B run."""
    common = [f"output_dir={tmp_path}", *OFFLINE, "checkpoint.save_every=20"]
    run_script("train_ddp.py", *common, "num_train_steps=20")
    resumed = run_script("train_ddp.py", *common, "num_train_steps=40")
    first, second = offline_runs(tmp_path)
    assert first["id"] == second["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert "Continuing W&B run " + first["id"] in resumed.stdout + resumed.stderr
    assert [row["_step"] for row in first["history"]] == [10, 20]
    assert [row["_step"] for row in second["history"]] == [30, 40]
    logged = [row["loss"] for row in first["history"] + second["history"]]
    assert logged == [m["loss"] for m in read_metrics(tmp_path)]

    fresh_checkpoints = f"checkpoint.ckpt_dir={tmp_path / 'fresh_checkpoints'}"
    run_script("train_ddp.py", *common, "num_train_steps=10", "checkpoint.resume=false", fresh_checkpoints)
    fresh = [run for run in offline_runs(tmp_path) if run["id"] != first["id"]]
    assert len(fresh) == 1 and fresh[0]["id"] == (tmp_path / "wandb_run_id").read_text().strip()
