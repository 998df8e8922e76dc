"""Configuration: TOML + overrides, validation messages, --print-config, fingerprint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomllib

from elastic_train.config.args import parse_cli
from elastic_train.config.job import FINGERPRINT_FIELDS, JobConfig, fingerprint
from elastic_train.config.load import from_dict, load_config, to_toml
from elastic_train.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_toml_then_overrides_with_types_from_the_dataclass(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[training]\nsteps = 7\nglobal_batch_size = 12\n[optimizer]\nname = "sgd"\nlr = 1\n'
        "[model.options]\ndepth = 3\n",
    )
    cfg = load_config(
        path,
        ["training.steps=9", "optimizer.lr=0.5", "checkpoint.async_save=false",
         "model.options.act=gelu", "model.options.width=4", "checkpoint.dir="],
    )  # fmt: skip
    assert cfg.training.steps == 9  # the override wins over the file
    assert cfg.training.global_batch_size == 12  # the file wins over the default
    assert cfg.optimizer.name == "sgd"
    assert cfg.optimizer.lr == 0.5 and isinstance(cfg.optimizer.lr, float)
    assert cfg.checkpoint.async_save is False
    assert cfg.checkpoint.dir == ""
    assert cfg.model.options == {"depth": 3, "act": "gelu", "width": 4}
    assert cfg.data == JobConfig().data  # untouched sections keep their defaults


def test_an_int_in_toml_is_accepted_for_a_float_field(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "[optimizer]\nlr = 1\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["training.stepz=3"], ["training.stepz", "steps"]),
        (["trainin.steps=3"], ["trainin", "training"]),
        (["training.steps=three"], ["training.steps", "integer"]),
        (["training.steps=-1"], ["training.steps", ">= 0"]),
        (["optimizer.name=lamb"], ["optimizer.name", "'adamw'", "'sgd'", "package.module:factory"]),
        (["schedule.name=step"], ["schedule.name", "'cosine'", "package.module:factory"]),
        (["data.collate_fn=pad"], ["data.collate_fn", "import string"]),
        (["model.loss_form=mean"], ["model.loss_form", "'per_sample'", "'sum_count'"]),
        (["checkpoint.async_save=maybe"], ["checkpoint.async_save", "true or false"]),
        (["optimizer.lr=0"], ["optimizer.lr", "> 0"]),
        (["training.epochs=2"], ["training.steps", "training.epochs"]),
        (["training.steps"], ["section.key=value"]),
        (["training.steps.x=1"], ["training.steps", "not a table"]),
    ],
)
def test_bad_overrides_name_the_field(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[trainer]\nsteps = 1\n", ["[trainer]", "training"]),
        ("[training]\nsteps = 1.5\n", ["training.steps", "integer"]),
        ("[training]\nsteps = true\n", ["training.steps", "integer"]),
        ('[optimizer]\nlr = "fast"\n', ["optimizer.lr", "number"]),
        ("[model]\nname = 3\n", ["model.name", "string"]),
        ("[model]\noptions = 3\n", ["model.options", "table"]),
        ("[training\n", ["not valid TOML"]),
    ],
)
def test_bad_toml_names_the_field(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    for name in names:
        assert name in str(info.value)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml")


def test_print_config_round_trips() -> None:
    cfg = load_config(None, ["training.steps=11", "model.options.act=gelu", "data.name=digits"])
    text = to_toml(cfg)
    assert from_dict(tomllib.loads(text)) == cfg
    assert "[training]\nsteps = 11\n" in text


def test_cli_parsing_accepts_legacy_local_rank_and_both_override_forms(tmp_path: Path) -> None:
    path = _write(tmp_path, "[training]\nsteps = 4\n")
    args = parse_cli(
        ["--local_rank=3", "--config", str(path), "--training.seed", "5",
         "--local-rank", "1", "--optimizer.lr=0.1", "--print-config"]
    )  # fmt: skip
    assert args.print_config
    assert (args.config.training.steps, args.config.training.seed) == (4, 5)
    assert args.config.optimizer.lr == 0.1
    with pytest.raises(ConfigError, match=r"unknown argument 'steps=3'"):
        parse_cli(["steps=3"])
    with pytest.raises(ConfigError, match=r"--training\.seed needs a value"):
        parse_cli(["--training.seed"])


def _changed(cfg: JobConfig, section: str, key: str, value: object) -> JobConfig:
    component = dataclasses.replace(getattr(cfg, section), **{key: value})
    return dataclasses.replace(cfg, **{section: component})


def test_fingerprint_is_stable_and_ignores_what_may_change_across_a_resume() -> None:
    cfg = JobConfig()
    assert fingerprint(cfg) == fingerprint(load_config(None, []))
    assert len(fingerprint(cfg)) == 16
    for section, key, value in [
        ("training", "micro_batch_size", 3),
        ("training", "steps", 999),
        ("optimizer", "lr", 0.5),
        ("schedule", "name", "constant"),
        ("checkpoint", "interval_steps", 7),
        ("checkpoint", "dir", "/elsewhere"),
        ("elastic", "pg_timeout_seconds", 5.0),
        ("logging", "audit_dir", "/tmp/a"),
    ]:
        assert fingerprint(_changed(cfg, section, key, value)) == fingerprint(cfg), key


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("model", "hidden_size", 32),
        ("model", "name", "mlp"),
        ("data", "name", "digits"),
        ("data", "seq_len", 32),
        ("training", "seed", 1),
        ("training", "global_batch_size", 64),
        ("training", "batch_mode", "per_worker"),
        ("optimizer", "name", "sgd"),
    ],
)
def test_fingerprint_changes_with_what_a_checkpoint_depends_on(
    section: str, key: str, value: object
) -> None:
    cfg = JobConfig()
    assert fingerprint(_changed(cfg, section, key, value)) != fingerprint(cfg)


def test_fingerprint_fields_exist() -> None:
    values = dataclasses.asdict(JobConfig())
    for name in FINGERPRINT_FIELDS:
        section, _, key = name.partition(".")
        assert section in values and (not key or key in values[section]), name


def test_factories_and_loss_form_by_import_string() -> None:
    job = ["optimizer.name=mypkg.opt:make", "optimizer.options.lr=0.1", "schedule.name=mypkg:s",
           "data.collate_fn=mypkg.data:pad", "model.loss_form=sum_count"]  # fmt: skip
    cfg = load_config(None, job)
    assert cfg.optimizer.name == "mypkg.opt:make" and cfg.optimizer.options == {"lr": 0.1}
    assert cfg.schedule.name == "mypkg:s" and cfg.data.collate_fn == "mypkg.data:pad"
    # What a checkpoint means depends on the loss form, the collate function and the factory.
    for override in ("model.loss_form=per_sample", "data.collate_fn=", "optimizer.name=adamw"):
        assert fingerprint(load_config(None, [*job, override])) != fingerprint(cfg), override
    assert fingerprint(load_config(None, [*job, "optimizer.options.lr=0.2"])) == fingerprint(cfg)
