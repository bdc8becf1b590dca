"""`dpfleet generate`: text sampled from a causal language model a run released."""

from __future__ import annotations

import argparse

from orchestrator.generate import generated_text


def add_generate_arguments(generate: argparse.ArgumentParser) -> None:
    """Add `generate`'s description and arguments to its parser."""
    generate.description = (
        "Load the causal language model a finished run released (model = { hf, task = \"causal-lm\" }; from its "
        "run directory or the folder `dpfleet export` wrote, as dpfleet.load does), continue PROMPT with "
        "transformers' generate, and print the prompt and its continuation, as the model folder's tokenizer "
        "decodes them."
    )
    generate.epilog = (
        "Sampling takes the model folder's generation_config.json for what is not given here. Generation reads "
        "only the released model, its tokenizer and PROMPT."
    )
    generate.add_argument("model", metavar="RUN_OR_EXPORT",
                          help="the run_dir of a finished `dpfleet train` run, or the folder from `dpfleet export`")
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=20, metavar="N",
                          help="the most tokens to add (default: 20)")
    generate.add_argument("--temperature", type=float, default=1.0, metavar="T",
                          help="the sampling temperature; 0 takes the likeliest token each time (default: 1.0)")
    generate.add_argument("--top-k", type=int, default=None, metavar="K",
                          help="sample only from the K likeliest tokens (default: the model folder's setting)")
    generate.add_argument("--top-p", type=float, default=None, metavar="P",
                          help="sample only from the fewest likeliest tokens whose probabilities reach P (nucleus "
                               "sampling; default: the model folder's setting)")
    generate.add_argument("--seed", type=int, default=None, metavar="N",
                          help="makes the sampling reproducible (default: fresh randomness each time)")
    generate.set_defaults(handler=f"{__name__}:run_generate_command")


def run_generate_command(args: argparse.Namespace) -> int:
    """Print the prompt and the text the model continued it with."""
    print(generated_text(args.model, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.top_k,
                         args.top_p))
    return 0
