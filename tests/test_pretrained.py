"""Pretrained Hugging Face models from a local folder (workers.pretrained): loading, LoRA, and both engines.

The models are tiny random-weight GPT-2, BERT and Llama configurations saved
to a temporary folder with a word-level tokenizer; nothing reaches a hub.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from orchestrator.config import build_config  # noqa: E402
from orchestrator.errors import UsageError  # noqa: E402
from workers.engines import clipped_sum, engine_plan  # noqa: E402
from workers.losses import ClassLoss  # noqa: E402
from workers.models import build_model, flat_parameters  # noqa: E402
from workers.pretrained import PAD_INPUT, load_tokenizer, next_token_labels, trainable_summary  # noqa: E402
from workers.tasks import build_loss  # noqa: E402

VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>"] + [f"w{i}" for i in range(59)]
RUN = {"steps": 1, "noise_multiplier": 1.0}
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "bert": ["query", "value"], "llama": ["q_proj", "v_proj"]}


def save_tiny_models(root: str) -> dict[str, str]:
    """Tiny random GPT-2, BERT and Llama models, each saved with a word-level tokenizer; name -> folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCABULARY)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="<eos>")
    size = len(VOCABULARY)
    torch.manual_seed(0)
    built = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=size, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=4, eos_token_id=4)),
        "bert": transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32)),
    }
    folders = {}
    for name, model in built.items():
        folders[name] = os.path.join(root, name)
        model.save_pretrained(folders[name])
        fast.save_pretrained(folders[name])
    return folders


def token_table(path, rows: int, length: int, seed: int, with_ids: bool = False) -> str:
    """A Parquet file of token ids [rows, length] from VOCABULARY's words, of lengths 3 to `length` padded with -1,
    labelled by their first token's parity; with `with_ids`, an `id` column first (row-0, row-1, ...)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, len(VOCABULARY), (rows, length))
    ids[np.arange(length)[None, :] >= rng.integers(3, length + 1, rows)[:, None]] = PAD_INPUT
    columns = {"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), length), "label": ids[:, 0] % 2}
    if with_ids:
        columns = {"id": [f"row-{index}" for index in range(rows)], **columns}
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(str(tmp_path_factory.mktemp("pretrained")))


def padded_ids(rows: int = 6, length: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, len(VOCABULARY), (rows, length), generator=generator)
    ids[0, 5:] = PAD_INPUT
    ids[3, 2:] = PAD_INPUT
    return ids


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


CASES = [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("bert", "sequence-classification"),
         ("gpt2", "sequence-classification"), ("llama", "token-classification")]


def task_batch(task: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = padded_ids()
    if task == "causal-lm":
        return ids, next_token_labels(ids)
    if task == "token-classification":
        labels = torch.where(ids == PAD_INPUT, -100, ids % 3)
        return ids, labels
    return ids, torch.arange(len(ids)) % 3


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(("name", "task"), CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_fast_engine_is_exact_against_vmap_with_padding(folders, name, task, adapter):
    spec = {"hf": folders[name], "task": task, **({} if task == "causal-lm" else {"num_labels": 3})}
    if adapter:
        spec["adapter"] = {"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": LORA_TARGETS[name]}
    model = no_dropout(build_model(spec))
    if adapter:
        with torch.no_grad():  # LoRA's B starts at zero, which would make A's gradients zero
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(std=0.1)
    ids, labels = task_batch(task)
    loss = build_loss("cross_entropy" if task == "sequence-classification" else "token_cross_entropy")
    weights = flat_parameters(model)
    fast, fast_norms = clipped_sum("fast", model, weights, ids, labels, 0.5, 16, loss, return_norms=True)
    vmap, vmap_norms = clipped_sum("vmap", model, weights, ids, labels, 0.5, 16, loss, return_norms=True)
    torch.testing.assert_close(fast, vmap, rtol=1e-4, atol=1e-6)
    for parameter_name in vmap_norms:
        torch.testing.assert_close(fast_norms[parameter_name], vmap_norms[parameter_name], rtol=1e-4, atol=1e-6)
    assert vmap.norm() > 0


def test_padding_does_not_change_an_examples_gradient(folders):
    """The same tokens with more padding give the same per-example gradient: padding is masked out."""
    model = no_dropout(build_model({"hf": folders["llama"], "task": "causal-lm"}))
    short = torch.tensor([[7, 8, 9, 10, PAD_INPUT, PAD_INPUT]])
    longer = torch.cat([short, torch.full((1, 4), PAD_INPUT)], dim=1)
    weights = flat_parameters(model)
    loss = build_loss("token_cross_entropy")
    first = clipped_sum("vmap", model, weights, short, next_token_labels(short), 1e6, 4, loss)
    second = clipped_sum("vmap", model, weights, longer, next_token_labels(longer), 1e6, 4, loss)
    torch.testing.assert_close(first, second, rtol=1e-4, atol=1e-6)


def test_lora_trains_only_the_adapter(folders):
    spec = {"hf": folders["gpt2"], "task": "causal-lm",
            "adapter": {"kind": "lora", "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["c_attn"]}}
    model = build_model(spec)
    names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert names and all("lora_" in name for name in names)
    assert flat_parameters(model).numel() == 2 * (2 * 16 + 48 * 2)  # two layers, each A [2, 16] and B [48, 2]
    assert trainable_summary(model).startswith("adapter only:")
    assert trainable_summary(build_model({"hf": folders["gpt2"], "task": "causal-lm"})).startswith("every parameter")


def test_a_sequence_classifier_with_an_adapter_trains_its_new_head(folders):
    spec = {"hf": folders["bert"], "task": "sequence-classification", "num_labels": 3,
            "adapter": {"kind": "lora", "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query"]}}
    names = [name for name, parameter in build_model(spec).named_parameters() if parameter.requires_grad]
    assert any("classifier" in name for name in names)
    assert all("lora_" in name or "classifier" in name for name in names)


def test_the_tokenizer_loads_from_the_folder(folders):
    tokenizer = load_tokenizer(folders["gpt2"])
    assert tokenizer("w1 w2")["input_ids"] == [VOCABULARY.index("w1"), VOCABULARY.index("w2")]


def test_a_hub_name_is_refused_with_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = build_config({**RUN, "model": {"hf": "gpt2", "task": "causal-lm"}})
    with pytest.raises(ValueError, match="not a folder on this machine.*download it first"):
        build_model(config.model_spec)


def test_the_task_decides_the_loss_and_the_adapter_needs_a_pretrained_model(folders):
    config = build_config({**RUN, "model": {"hf": folders["gpt2"], "task": "causal-lm"}})
    assert config.loss == "token_cross_entropy"
    assert config.model_spec == {"hf": folders["gpt2"], "task": "causal-lm", "adapter": None}
    with pytest.raises(UsageError, match="trains on loss = \"cross_entropy\""):
        build_config({**RUN, "model": {"hf": folders["bert"], "task": "sequence-classification"},
                      "loss": "token_cross_entropy"})
    with pytest.raises(UsageError, match="adapter adds LoRA factors to a pretrained model"):
        build_config({**RUN, "adapter": {"kind": "lora", "target_modules": ["fc"]}})
    with pytest.raises(UsageError, match="model.task must be one of"):
        build_config({**RUN, "model": {"hf": folders["gpt2"], "task": "translation"}})
    with pytest.raises(UsageError, match="adapter.r must be"):
        build_config({**RUN, "model": {"hf": folders["gpt2"], "task": "causal-lm"},
                      "adapter": {"kind": "lora", "r": 0, "target_modules": ["c_attn"]}})


def test_every_process_builds_the_same_frozen_weights_the_folder_lacks(folders):
    """BERT's pooler is not in a masked-LM folder: under LoRA it stays frozen, so the driver and every worker must
    draw it alike, whatever their generators' states."""
    spec = {"hf": folders["bert"], "task": "sequence-classification", "num_labels": 3,
            "adapter": {"kind": "lora", "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["query"]}}
    torch.manual_seed(1)
    first = build_model(spec).state_dict()
    torch.manual_seed(2)
    second = build_model(spec).state_dict()
    after_build = torch.rand(1)
    pooler = [name for name in first if "pooler" in name]
    assert pooler and all(torch.equal(first[name], second[name]) for name in first)
    torch.manual_seed(2)
    assert torch.equal(torch.rand(1), after_build)  # the global generator is left as it was
