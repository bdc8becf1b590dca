"""Pretrained Hugging Face models from a local folder, with an optional LoRA adapter, as dpfleet models.

A job names one with ``model = { hf = "PATH", task = "..." }`` and may add
``adapter = { kind = "lora", r = 8, alpha = 16, target_modules = [...] }``.
The config check (``parse_model_table``, ``parse_adapter``) and the workers
(``build_pretrained``) share what is here; ``transformers`` and ``peft`` are
imported on first use, so a job without them never loads them.

Models load with ``local_files_only=True`` from a folder on the machine:
workers never reach a hub. A hub name is refused with how to download it.

**Inputs.** The model takes token ids [B, T] (int64) padded with
``PAD_INPUT`` (-1, which no tokenizer gives). ``TokenModel`` derives from
them, per example, everything the Hugging Face model takes besides: the
attention mask (as a prepared 4-D additive mask, so that no data-dependent
branch of the library's mask code runs under ``torch.func.vmap``), the
position ids (counted over the example's own tokens) and, for encoders that
have them, zero token type ids. Every one of these is a function of that
example's ids alone, so the model keeps examples independent, which the
engines check on synthetic examples before any private one.

**Tasks.** The task fixes the head, the loss and the labels' layout:

- ``sequence-classification``: labels [B] (a class each), loss ``cross_entropy``;
- ``token-classification``: labels [B, T], -100 where a position does not
  count, loss ``token_cross_entropy``;
- ``causal-lm``: labels [B, T], the next token or -100 (``next_token_labels``),
  loss ``token_cross_entropy``.

**Adapters.** With a LoRA adapter (through ``peft``) only the adapter's
factors (and, for classification, the new head) are trainable: the frozen
base is not part of the flat parameter vector, so it is never clipped,
noised or sent. Without one, every parameter is trained (full fine-tuning).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from workers.pretrained_spec import PEFT_TASK_TYPES, IGNORED_LABEL, PAD_INPUT, TASKS, check_folder

# --- building -------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError as error:
        raise ValueError("a model = { hf = ... } needs transformers: pip install 'dpfleet[hf]'") from error
    return transformers


def load_tokenizer(path: str):
    """The tokenizer saved in the model folder ``path`` (``local_files_only``); its pad token set where it had none."""
    tokenizer = _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """transformers' and peft's loading chatter held back: progress bars, load reports and deprecation warnings,
    which every worker would print again. What a run says about its model is its own start line."""
    logging = _transformers().utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _first(token_id: int | list[int] | None, default: int) -> int:
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    return default if token_id is None else int(token_id)


def _loader(spec: Mapping) -> tuple[type, dict]:
    """The transformers auto class of the spec's task and the options its folder loads with."""
    check_folder(spec["hf"])
    auto_class = getattr(_transformers(), TASKS[spec["task"]][0])
    return auto_class, {"local_files_only": True, **({"num_labels": spec["num_labels"]} if "num_labels" in spec
                                                      else {})}


def _pretrained_model(spec: Mapping) -> nn.Module:
    auto_class, options = _loader(spec)
    model = auto_class.from_pretrained(spec["hf"], attn_implementation="eager", dtype=torch.float32, **options)
    config = model.config
    if not 0 <= _first(config.pad_token_id, -1) < getattr(config, "vocab_size", 0):
        # Padding positions are masked out, but their ids must still index the embedding, and GPT-2's classifier
        # finds each example's last token by the pad id: the end-of-sequence token where it is in range, else 0.
        eos = _first(config.eos_token_id, -1)
        config.pad_token_id = eos if 0 <= eos < getattr(config, "vocab_size", 0) else 0
    return model


def _with_adapter(model: nn.Module, task: str, adapter: Mapping) -> nn.Module:
    try:
        import peft
    except ModuleNotFoundError as error:
        raise ValueError("adapter = { kind = \"lora\" } needs peft: pip install 'dpfleet[hf]'") from error
    targets = list(adapter["target_modules"])
    # GPT-2's Conv1D holds its weight transposed, which peft must be told (it warns and guesses otherwise).
    transposed = any(type(module).__name__ == "Conv1D" for name, module in model.named_modules()
                     if name.rpartition(".")[2] in targets)
    config = peft.LoraConfig(r=adapter["r"], lora_alpha=adapter["alpha"], lora_dropout=adapter["dropout"],
                             target_modules=targets, task_type=PEFT_TASK_TYPES[task], fan_in_fan_out=transposed)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as error:
        raise ValueError(f"adapter.target_modules {list(adapter['target_modules'])}: {error}") from None


class TokenModel(nn.Module):
    """A Hugging Face model that takes token ids [B, T] padded with ``PAD_INPUT`` and returns its logits.

    ``hf`` is the ``transformers`` model (or its ``peft`` wrapper); ``causal``
    says whether a position attends only to those before it. Each example's
    mask, position ids and token type ids come from its own ids.
    """

    def __init__(self, hf: nn.Module, causal: bool, pad_token_id: int, token_types: bool) -> None:
        super().__init__()
        self.hf = hf
        self.causal = causal
        self.pad_token_id = pad_token_id
        self.token_types = token_types

    def forward(self, ids: Tensor) -> Tensor:
        """Logits [B, C] (sequence classification) or [B, T, C] for token ids [B, T]."""
        present = ids != PAD_INPUT
        tokens = torch.where(present, ids, torch.full_like(ids, self.pad_token_id))
        positions = (present.long().cumsum(-1) - 1).clamp(min=0)
        arguments = {"input_ids": tokens, "attention_mask": self._additive_mask(present), "position_ids": positions}
        if self.token_types:
            arguments["token_type_ids"] = torch.zeros_like(tokens)
        return self.hf(**arguments).logits

    def _additive_mask(self, present: Tensor) -> Tensor:
        """[B, 1, T, T]: 0 where query q may attend to key k (k is a token, and k <= q when causal), else -inf-like."""
        allowed = present[:, None, None, :]
        if self.causal:
            length = present.shape[-1]
            order = torch.ones(length, length, dtype=torch.bool, device=present.device).tril()
            allowed = allowed & order
        allowed = allowed.expand(present.shape[0], 1, present.shape[-1], present.shape[-1])
        zero = torch.zeros((), dtype=torch.float32, device=present.device)
        return torch.where(allowed, zero, torch.finfo(torch.float32).min)


def _is_decoder_only(model_type: str) -> bool:
    """Whether a model type attends causally whatever its head: one with no masked-LM form (GPT-2, Llama)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


INITIALISATION_SEED = 0
"""The seed of the draws that fill what a pretrained folder does not hold (``build_pretrained``)."""


def build_pretrained(spec: Mapping) -> TokenModel:
    """The model a ``model = { hf, task }`` spec (as ``parse_model_table`` left it, with ``adapter`` where the job
    has one) names, in float32, ready to train: a ``TokenModel`` around it.

    Weights the folder does not hold (a classifier's new head, a pooler the saved model lacks) and the adapter's
    factors are drawn from a generator seeded with ``INITIALISATION_SEED``: the driver and every worker build the
    same model, frozen weights included, which the flat vector of trainable ones would not make so. The draws are
    public, as any initialisation is, and the global generator is left as it was.
    """
    with _quietly(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(INITIALISATION_SEED)
        model = _pretrained_model(spec)
        if spec.get("adapter") is not None:
            model = _with_adapter(model, spec["task"], spec["adapter"])
    config = model.config
    causal = spec["task"] == "causal-lm" or _is_decoder_only(config.model_type)
    token_types = getattr(config, "type_vocab_size", 0) > 0 and config.model_type != "gpt2"
    return TokenModel(model, causal, int(config.pad_token_id), token_types)


def weights_not_in_folder(spec: Mapping) -> set[str]:
    """The weights of a ``model = { hf, task }`` spec's model that its folder does not hold, by name: those
    transformers draws at random as it loads (a classifier's new head; a pooler the saved model had none of).
    Read on the meta device: no weight is loaded."""
    auto_class, options = _loader(spec)
    with _quietly():
        _, found = auto_class.from_pretrained(spec["hf"], device_map="meta", output_loading_info=True, **options)
    return set(found["missing_keys"])


def load_adapter(model: TokenModel, folder: str) -> None:
    """Put the LoRA adapter that peft saved in ``folder`` onto ``model``'s pretrained model, for inference, as
    ``peft.PeftModel.from_pretrained`` loads it."""
    import peft

    with _quietly():
        model.hf = peft.PeftModel.from_pretrained(model.hf, folder)


def next_token_labels(ids: Tensor) -> Tensor:
    """A causal LM's labels for token ids [B, T] padded with ``PAD_INPUT``: position t's label is token t + 1,
    ``IGNORED_LABEL`` where there is none (the last position, padding)."""
    labels = torch.full_like(ids, IGNORED_LABEL)
    labels[:, :-1] = ids[:, 1:]
    return torch.where(labels == PAD_INPUT, torch.full_like(labels, IGNORED_LABEL), labels)


def trainable_summary(model: nn.Module) -> str:
    """What of a model is trained: "adapter only: N of M parameters trainable (the frozen base is never clipped,
    noised or sent)" or "every parameter trainable (full fine-tuning): M"."""
    total = sum(parameter.numel() for parameter in model.parameters())
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    if trainable == total:
        return f"every parameter trainable (full fine-tuning): {total:,}"
    return (f"adapter only: {trainable:,} of {total:,} parameters trainable (the frozen base is never clipped, "
            "noised or sent)")
