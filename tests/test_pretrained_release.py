"""A pretrained model's release as files a transformers user loads: `dpfleet export` (an adapter, merged, or the whole
model), `dpfleet.load`, `dpfleet predict` on token ids and text, and `dpfleet generate`.

Most runs here are made without training: a run directory as a finished run
leaves it (config.json, a checkpoint, summary.json), its trainable weights
and their moving average moved from the pretrained ones at random. One test
trains a LoRA sequence classifier for two steps on a local Ray.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402
from test_api import import_dpfleet  # noqa: E402
from test_pretrained import LORA_TARGETS, VOCABULARY, save_tiny_models, token_table  # noqa: E402

from accounting.accountants import get_accountant  # noqa: E402
from accounting.events import SampledGaussian  # noqa: E402
from orchestrator import release  # noqa: E402
from orchestrator.checkpoint import latest_checkpoint, save_checkpoint  # noqa: E402
from orchestrator.cli import main  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.errors import UsageError  # noqa: E402
from orchestrator.export import export_run, read_run, released_model  # noqa: E402
from orchestrator.generate import generated_text  # noqa: E402
from workers.data import file_sha256  # noqa: E402
from workers.models import build_model, flat_parameters  # noqa: E402
from workers.pretrained import PAD_INPUT, TokenModel  # noqa: E402

LENGTH = 8
ROWS = 32
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}
AUTO_CLASSES = {"causal-lm": transformers.AutoModelForCausalLM,
                "sequence-classification": transformers.AutoModelForSequenceClassification}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The tiny pretrained models' folders and a token-id dataset."""
    root = tmp_path_factory.mktemp("pretrained-release")
    dataset = {"format": "parquet", "train": token_table(root / "train.parquet", ROWS, LENGTH, 1),
               "test": token_table(root / "test.parquet", ROWS, LENGTH, 2), "num_classes": 2}
    return root, save_tiny_models(str(root / "models")), dataset


def run_config(setting, name: str, base: str, task: str, lora: bool, **overrides):
    root, folders, dataset = setting
    model = {"hf": folders[base], "task": task, **({"num_labels": 2} if task != "causal-lm" else {})}
    values = dict(model=model, dataset=dataset, steps=2, batch_size=8, noise_multiplier=1.0, clip_norm=1.0,
                  learning_rate=0.1, seed=1, run_dir=str(root / name), workers=1)
    if lora:
        values["adapter"] = {"kind": "lora", "r": 2, "alpha": 4, "target_modules": LORA_TARGETS[base]}
    values.update(overrides)
    return build_config(values)


def made_up_run(setting, name: str, base: str, task: str, lora: bool):
    """A run directory as a finished 2-step run with ema_decay leaves it, its trained weights and their average
    moved from the pretrained ones at random: what export reads, without Ray."""
    config = run_config(setting, name, base, task, lora, ema_decay=0.5)
    torch.manual_seed(len(name))
    model = build_model(config.model_spec)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    average = flat_parameters(model) + torch.randn(flat_parameters(model).shape) * 0.2
    run_dir = Path(config.run_dir)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    save_checkpoint(run_dir, "0123456789abcdef", 2, {"version": 2, "step": 2, "noise_multiplier": 1.0,
                                                     "model": model.state_dict(), "ema_weights": average})
    epsilon = get_accountant("pld").epsilon(SampledGaussian(8 / ROWS, 1.0, 2), 1e-5)
    (run_dir / "summary.json").write_text(json.dumps({
        "epsilon": epsilon, "epsilon_label": "pld", "epsilon_rigorous": True, "delta": 1e-5, "accountant": "pld",
        "steps": 2, "noise_multiplier": 1.0, "sampling_rate": 8 / ROWS, "clip_norm": 1.0, "test_loss": 0.7}))
    return run_dir


# GPT-2's classifier has a new head only, which the adapter carries; BERT's has a pooler too, which a masked LM's
# folder does not hold and peft does not save: its adapter is refused, and merged.
ADAPTER_CASES = [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("gpt2", "sequence-classification")]
MERGED_CASES = [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("gpt2", "sequence-classification"),
                ("bert", "sequence-classification")]
FULL_CASES = [("gpt2", "causal-lm"), ("bert", "sequence-classification")]


class MadeUpRuns(dict):
    """(base, task, lora) -> a made-up finished run of it, made on first use."""

    def __init__(self, setting):
        super().__init__()
        self.setting = setting

    def __missing__(self, key):
        base, task, lora = key
        self[key] = made_up_run(self.setting, f"{base}-{task}-{'lora' if lora else 'full'}", base, task, lora)
        return self[key]


@pytest.fixture(scope="module")
def runs(setting):
    return MadeUpRuns(setting)


def padded_ids(seed: int = 5) -> torch.Tensor:
    ids = torch.randint(5, len(VOCABULARY), (4, LENGTH), generator=torch.Generator().manual_seed(seed))
    ids[1, 5:] = PAD_INPUT
    ids[2, 3:] = PAD_INPUT
    return ids


def plain_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A transformers model's logits as its users call it: right-padded ids with an attention mask."""
    mask = ids != PAD_INPUT
    with torch.no_grad():
        return model(input_ids=torch.where(mask, ids, 0), attention_mask=mask.long()).logits


def assert_same_logits(expected: torch.Tensor, got: torch.Tensor, ids: torch.Tensor) -> None:
    """Equal where they count: every position of a sequence's logits, a token's only where it is a token."""
    if expected.dim() == 3:
        mask = ids != PAD_INPUT
        expected, got = expected[mask], got[mask]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def released_logits(run_dir, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return released_model(read_run(run_dir))(ids)


def exported(run_dir, out, *flags: str) -> dict:
    """`dpfleet export RUN_DIR --out OUT [flags]`, observed at the release boundary; the card it wrote."""
    with release.observe() as seen:
        assert main(["export", str(run_dir), "--out", str(out), *flags]) == 0
    files = set(os.listdir(out))
    assert {("export folder", name) for name in files} <= set(seen)
    assert ("model card", "privacy") in seen
    return json.loads((out / "model-card.json").read_text())


def plain_base(setting, base: str, task: str):
    """The pretrained model as transformers loads it from its folder, for an adapter to go on: a classifier with
    its tokenizer's padding id, which GPT-2's finds each sequence's last token by."""
    folder = setting[1][base]
    options = {} if task == "causal-lm" else {
        "num_labels": 2, "pad_token_id": transformers.AutoTokenizer.from_pretrained(folder).pad_token_id}
    return AUTO_CLASSES[task].from_pretrained(folder, **options).eval()


# --- export, and plain transformers and peft loading it ---------------------------------------------------------


@pytest.mark.parametrize(("base", "task"), ADAPTER_CASES, ids=[f"{base}-{task}" for base, task in ADAPTER_CASES])
def test_an_adapter_export_is_peft_s_layout_and_plain_peft_loads_the_released_model(setting, runs, tmp_path, base,
                                                                                     task):
    run_dir = runs[base, task, True]
    out = tmp_path / "adapter"
    card = exported(run_dir, out)
    assert set(os.listdir(out)) == {"adapter_config.json", "adapter_model.safetensors", "model-card.json",
                                    *TOKENIZER_FILES}
    tensors = load_file(out / "adapter_model.safetensors")
    # The adapter's factors (and a classifier's head), nothing of the frozen base.
    assert tensors and all("lora_" in name or "score" in name for name in tensors)
    assert any("score" in name for name in tensors) == (task != "causal-lm")
    assert card["weights"] == {"file": "adapter_model.safetensors", "layout": "adapter",
                               "sha256": file_sha256(out / "adapter_model.safetensors"),
                               "parameters": "moving average of the trained weights", "ema_decay": 0.5}
    assert card["model"]["spec"]["hf"] == setting[1][base] and card["model"]["adapter"]["r"] == 2
    assert card["privacy"]["epsilon"] == json.loads((run_dir / "summary.json").read_text())["epsilon"]
    plain = peft.PeftModel.from_pretrained(plain_base(setting, base, task), str(out)).eval()
    ids = padded_ids()
    expected = released_logits(run_dir, ids)
    assert_same_logits(expected, plain_logits(plain, ids), ids)
    # The released weights are the moving average, not the trained ones the checkpoint's model entry holds.
    trained = build_model(read_run(run_dir).config.model_spec)
    trained.load_state_dict(latest_checkpoint(run_dir)[1]["model"])
    with torch.no_grad():
        assert not torch.allclose(trained(ids), expected, atol=1e-3)


@pytest.mark.parametrize(("base", "task"), MERGED_CASES, ids=[f"{base}-{task}" for base, task in MERGED_CASES])
def test_a_merged_export_is_the_whole_model_that_plain_transformers_loads(setting, runs, tmp_path, base, task):
    run_dir = runs[base, task, True]
    out = tmp_path / "merged"
    card = exported(run_dir, out, "--merged")
    generation = {"generation_config.json"} if task == "causal-lm" else set()
    assert set(os.listdir(out)) == {"config.json", "model.safetensors", "model-card.json", *TOKENIZER_FILES,
                                    *generation}
    assert card["weights"]["layout"] == "merged" and card["weights"]["file"] == "model.safetensors"
    assert not any("lora" in name for name in load_file(out / "model.safetensors"))
    plain = AUTO_CLASSES[task].from_pretrained(str(out)).eval()
    ids = padded_ids()
    assert_same_logits(released_logits(run_dir, ids), plain_logits(plain, ids), ids)


@pytest.mark.parametrize(("base", "task"), FULL_CASES, ids=[f"{base}-{task}" for base, task in FULL_CASES])
def test_a_fully_fine_tuned_export_is_the_whole_model_and_merged_is_refused(setting, runs, tmp_path, capsys, base,
                                                                           task):
    run_dir = runs[base, task, False]
    out = tmp_path / "full"
    assert main(["export", str(run_dir), "--out", str(out), "--merged"]) == 2
    assert "this run fine-tuned every parameter" in capsys.readouterr().err and not out.exists()
    assert exported(run_dir, out)["weights"]["layout"] == "full"
    plain = AUTO_CLASSES[task].from_pretrained(str(out)).eval()
    ids = padded_ids()
    assert_same_logits(released_logits(run_dir, ids), plain_logits(plain, ids), ids)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("w1 w2")["input_ids"] == [VOCABULARY.index("w1"), VOCABULARY.index("w2")]


# --- dpfleet.load ------------------------------------------------------------------------------------------------


def test_load_gives_the_transformers_model_in_eval_mode_from_a_run_and_each_export(setting, runs, tmp_path):
    dpfleet = import_dpfleet()
    run_dir = runs["llama", "causal-lm", True]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    export_run(run_dir, adapter)
    export_run(run_dir, merged, merged=True)
    ids = padded_ids()
    expected = released_logits(run_dir, ids)
    for source, kind in ((run_dir, peft.PeftModel), (adapter, peft.PeftModel), (merged, transformers.LlamaForCausalLM)):
        model = dpfleet.load(source)
        assert isinstance(model, kind) and not isinstance(model, TokenModel), source
        assert not model.training and not any(module.training for module in model.modules())
        assert_same_logits(expected, plain_logits(model, ids), ids)
    full = dpfleet.load(runs["bert", "sequence-classification", False])
    assert isinstance(full, transformers.BertForSequenceClassification)


def test_an_adapter_that_would_not_give_the_released_model_back_is_refused_with_merged_as_the_fix(
        setting, runs, tmp_path, capsys):
    """BERT's classifier has a pooler that a masked LM's folder does not hold: transformers draws it at random on
    each load, and peft saves only the adapter and the new head, so a peft load would not be the released model."""
    run_dir = runs["bert", "sequence-classification", True]
    assert main(["export", str(run_dir), "--out", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert "bert.pooler.dense.bias, bert.pooler.dense.weight" in err and "export with --merged" in err
    assert os.listdir(tmp_path) == []
    plain = peft.PeftModel.from_pretrained(plain_base(setting, "bert", "sequence-classification"),
                                           str(unchecked_adapter_export(run_dir, tmp_path / "forced")))
    ids = padded_ids()
    assert not torch.allclose(plain_logits(plain.eval(), ids), released_logits(run_dir, ids), atol=1e-3)


def unchecked_adapter_export(run_dir, out):
    """peft's layout of a run's released model, saved without the export's check: what the check refuses."""
    model = released_model(read_run(run_dir))
    model.hf.save_pretrained(str(out))
    return out


def test_an_adapter_whose_pretrained_folder_is_gone_is_refused_with_the_fix(setting, runs, tmp_path):
    out = tmp_path / "adapter"
    export_run(runs["gpt2", "causal-lm", True], out)
    card = json.loads((out / "model-card.json").read_text())
    card["model"]["spec"]["hf"] = str(tmp_path / "moved-away")
    (out / "model-card.json").write_text(json.dumps(card))
    with pytest.raises(UsageError, match="moved-away', which is not a folder on this machine.*with --merged"):
        import_dpfleet().load(out)


# --- what an export may write and replace -------------------------------------------------------------------------


def test_an_undeclared_file_a_library_writes_is_refused_and_nothing_is_left(setting, runs, tmp_path, monkeypatch):
    """The attacker's channel: a library that starts writing a file beside the weights (here a tokenizer that also
    writes its training texts). The export refuses it at the release boundary and leaves no folder."""
    import orchestrator.pretrained_export as pretrained_export

    load_tokenizer = pretrained_export.load_tokenizer

    class Leaky:
        def __init__(self, folder):
            self.tokenizer = load_tokenizer(folder)

        def save_pretrained(self, folder):
            with open(os.path.join(folder, "training_texts.txt"), "w") as handle:
                handle.write("w1 w2 w3\n")
            return self.tokenizer.save_pretrained(folder)

    monkeypatch.setattr(pretrained_export, "load_tokenizer", Leaky)
    out = tmp_path / "export"
    with pytest.raises(release.UndeclaredOutput, match="training_texts.txt"):
        export_run(runs["gpt2", "causal-lm", True], out)
    assert os.listdir(tmp_path) == []


def test_an_export_replaces_only_an_earlier_export_and_is_a_folder(setting, runs, tmp_path, capsys):
    run_dir = runs["gpt2", "causal-lm", True]
    out = tmp_path / "export"
    export_run(run_dir, out)
    (out / "stale.bin").write_bytes(b"from before")
    export_run(run_dir, out, merged=True)
    assert "stale.bin" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["export"]
    # Neither the pretrained model's folder nor the run directory is an earlier export.
    model_folder = setting[1]["gpt2"]
    before = sorted(os.listdir(model_folder))
    for refused in (model_folder, run_dir):
        assert main(["export", str(run_dir), "--out", str(refused)]) == 2
        assert "is not an earlier export" in capsys.readouterr().err
    assert sorted(os.listdir(model_folder)) == before
    assert main(["export", str(run_dir), "--out", str(tmp_path / "model.safetensors")]) == 2
    assert "a pretrained model's export is a Hugging Face folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors"), "--merged"]) == 2
    assert "trained no pretrained model" in capsys.readouterr().err


# --- a trained run ------------------------------------------------------------------------------------------------


def test_a_trained_lora_classifier_exports_loads_and_predicts_as_it_evaluated(local_ray, setting, tmp_path):
    from orchestrator.trainer import Trainer

    config = run_config(setting, "trained", "gpt2", "sequence-classification", True, ema_decay=0.5)
    trainer = Trainer(config, show_progress=False, out=io.StringIO())
    summary = trainer.run()
    run_dir = setting[0] / "trained"
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert exported(run_dir, adapter)["test_metrics"]["test_loss"] == summary["test_loss"]
    exported(run_dir, merged, "--merged")
    inputs, labels = (torch.tensor(pq.read_table(setting[2]["test"]).column(name).to_pylist())
                      for name in ("input_ids", "label"))
    with_adapter = peft.PeftModel.from_pretrained(plain_base(setting, "gpt2", "sequence-classification"),
                                                  str(adapter)).eval()
    whole = transformers.AutoModelForSequenceClassification.from_pretrained(str(merged)).eval()
    logits = plain_logits(with_adapter, inputs)
    torch.testing.assert_close(plain_logits(whole, inputs), logits, rtol=1e-4, atol=1e-5)
    # The exported model is the one the run evaluated: its test loss, from plain transformers.
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(summary["test_loss"], rel=1e-4)
    _, outputs, _ = predicted(merged, setting[2]["test"], tmp_path / "p.csv")
    torch.testing.assert_close(outputs, logits, rtol=1e-4, atol=1e-5)


# --- predict ------------------------------------------------------------------------------------------------------


def predicted(source, data, out) -> tuple[list[str], torch.Tensor, list]:
    """`dpfleet predict`'s CSV: its header, its outputs and its first column."""
    assert main(["predict", str(source), "--data", str(data), "--out", str(out)]) == 0
    header, *lines = out.read_text().splitlines()
    first = header.split(",").index("prediction")
    rows = [line.split(",") for line in lines]
    outputs = torch.tensor([[float(value) for value in row[first + 1:]] for row in rows])
    predictions = [int(row[first]) for row in rows]
    assert predictions == outputs.argmax(dim=1).tolist()
    return header.split(","), outputs, [row[0] for row in rows]


def test_predict_classifies_token_ids_and_text_from_a_run_and_its_exports(setting, runs, tmp_path, capsys):
    run_dir = runs["gpt2", "sequence-classification", True]
    export_run(run_dir, tmp_path / "adapter")
    export_run(run_dir, tmp_path / "merged", merged=True)
    table = token_table(tmp_path / "new.parquet", ROWS, LENGTH, 7, with_ids=True)
    ids = torch.tensor(pq.read_table(table).column("input_ids").to_pylist())
    expected_ids = released_logits(run_dir, ids)
    texts = ["w1 w2 w3", "w7 w9 w11 w13 w4", "w40"]
    (tmp_path / "new.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"id": index * 10, "body": text}) + "\n"
                                                for index, text in enumerate(texts)))
    (tmp_path / "new.csv").write_text("id,text\n" + "".join(f"r{index},{text}\n" for index, text in enumerate(texts)))
    tokens = [[VOCABULARY.index(word) for word in text.split()] for text in texts]
    text_ids = torch.tensor([row + [PAD_INPUT] * (5 - len(row)) for row in tokens])
    expected_text = released_logits(run_dir, text_ids)
    for source in (run_dir, tmp_path / "adapter", tmp_path / "merged"):
        header, outputs, first = predicted(source, table, tmp_path / "p.csv")
        assert header == ["id", "prediction", "output_0", "output_1"] and first == [f"row-{i}" for i in range(ROWS)]
        torch.testing.assert_close(outputs, expected_ids, rtol=1e-4, atol=1e-5)
        header, outputs, _ = predicted(source, tmp_path / "new.txt", tmp_path / "p.csv")
        assert header == ["prediction", "output_0", "output_1"]
        torch.testing.assert_close(outputs, expected_text, rtol=1e-4, atol=1e-5)
    # The same token ids unpadded, as lists of their own lengths: cut and padded to the length the run trained on.
    unpadded = pa.table({"input_ids": [[token for token in row if token != PAD_INPUT] for row in ids.tolist()]})
    pq.write_table(unpadded, tmp_path / "unpadded.parquet")
    _, outputs, _ = predicted(run_dir, tmp_path / "unpadded.parquet", tmp_path / "p.csv")
    torch.testing.assert_close(outputs, expected_ids, rtol=1e-4, atol=1e-5)
    assert main(["predict", str(run_dir), "--data", str(tmp_path / "new.jsonl"), "--out", str(tmp_path / "p.csv"),
                 "--text-column", "body"]) == 0
    assert [line.split(",")[0] for line in (tmp_path / "p.csv").read_text().splitlines()] == ["id", "0", "10", "20"]
    header, outputs, first = predicted(run_dir, tmp_path / "new.csv", tmp_path / "p.csv")
    assert header[0] == "id" and first == ["r0", "r1", "r2"]
    torch.testing.assert_close(outputs, expected_text, rtol=1e-4, atol=1e-5)
    assert main(["predict", str(run_dir), "--data", str(tmp_path / "new.jsonl"), "--out", str(tmp_path / "p.csv")]) == 2
    assert "no text column 'text' (columns: id, body); name the one that holds the text with --text-column" in (
        capsys.readouterr().err)
    assert main(["predict", str(runs["gpt2", "causal-lm", True]), "--data", str(table), "--out",
                 str(tmp_path / "p.csv")]) == 2
    assert "dpfleet generate samples text from it" in capsys.readouterr().err


# --- generate ------------------------------------------------------------------------------------------------------


def plain_generation(folder, prompt: str, seed: int, **options) -> str:
    """What a transformers user samples from an export folder with the same seed."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    encoded = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        tokens = model.generate(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                                pad_token_id=tokenizer.pad_token_id, **options)
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


def test_generate_samples_from_the_released_model_as_transformers_does(setting, runs, tmp_path, capsys):
    run_dir = runs["gpt2", "causal-lm", True]
    merged = tmp_path / "merged"
    export_run(run_dir, merged, merged=True)
    with release.observe() as seen:
        assert main(["generate", str(merged), "--prompt", "w1 w2", "--max-new-tokens", "6", "--seed", "3"]) == 0
    assert ("generated text", "text") in seen
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("w1 w2 ") and len(printed.split()) > 2
    sampled = plain_generation(merged, "w1 w2", 3, max_new_tokens=6, do_sample=True, temperature=1.0)
    assert printed == sampled
    greedy = plain_generation(merged, "w1 w2", 0, max_new_tokens=6, do_sample=False)
    for source in (run_dir, merged):
        assert generated_text(source, "w1 w2", 6, temperature=0.0) == greedy
    assert len({generated_text(run_dir, "w1 w2", 6, temperature=5.0) for _ in range(4)}) > 1  # fresh draws
    assert main(["generate", str(runs["bert", "sequence-classification", True]), "--prompt", "w1"]) == 2
    assert "dpfleet predict classifies with it" in capsys.readouterr().err
    assert main(["generate", str(merged), "--prompt", "w1", "--temperature", "-1"]) == 2
    assert "--temperature must be >= 0" in capsys.readouterr().err
    # Top-k 1 is the likeliest token each time; top-k and top-p reach transformers' sampling as given.
    assert generated_text(merged, "w1 w2", 6, temperature=1.0, top_k=1) == greedy
    assert main(["generate", str(merged), "--prompt", "w1 w2", "--max-new-tokens", "6", "--seed", "3", "--top-k",
                 "3", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.strip() == plain_generation(merged, "w1 w2", 3, max_new_tokens=6, do_sample=True,
                                                               temperature=1.0, top_k=3, top_p=0.9)
    for flags, message in ((["--top-k", "0"], "--top-k must be >= 1"),
                           (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
                           (["--temperature", "0", "--top-p", "0.5"], "--top-p would change nothing")):
        assert main(["generate", str(merged), "--prompt", "w1", *flags]) == 2
        assert message in capsys.readouterr().err
