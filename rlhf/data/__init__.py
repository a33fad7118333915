"""Data: sources -> raw rows -> canonical examples (SFT / pairs / prompts) -> token ids -> batches.

    rows = load_rows("data/default/sft.jsonl")                      # list[Row] (dict + origin)
    rows = take_split(rows, "2,4,4", stage=0, seed=1234)            # DeepSpeed-Chat data_split
    examples = parse_sft(rows, tokenizer)                           # shape detected, checked
    # (SFTExample, or ChatExample: a conversation trained on every assistant turn, rlhf/data/chat.py)
    features, stats = tokenize_sft(examples, tokenizer, 512, 256)   # over-long rule, counted
    batch = collate_sft(features[:8], pad_id=tokenizer.pad_token_id)
"""
from rlhf.config.validate import parse_data_split
from rlhf.core.errors import DataFileNotFoundError, DataFormatError
from rlhf.core.hub import SUPPORTED_EXTENSIONS
from rlhf.data.records import (
    PAIR_SHAPES,
    PROMPT_SHAPES,
    SFT_SHAPES,
    UNPAIRED_SHAPES,
    ChatExample,
    PairExample,
    PromptExample,
    Row,
    SFTExample,
    UnpairedExample,
    parse_pairs,
    parse_prompts,
    parse_sft,
    parse_unpaired,
)
from rlhf.data.sources import load_rows
from rlhf.data.split import split_indices, take_split
from rlhf.data.tokenize import (
    IGNORE_INDEX,
    collate_pairs,
    collate_prompts,
    collate_shared_pairs,
    collate_sft,
    mismatched_rows,
    tokenize_pairs,
    tokenize_prompts,
    tokenize_sft,
    tokenize_unpaired,
)

__all__ = [
    "DataFileNotFoundError", "DataFormatError", "IGNORE_INDEX", "PAIR_SHAPES", "PROMPT_SHAPES",
    "SFT_SHAPES", "SUPPORTED_EXTENSIONS", "UNPAIRED_SHAPES", "ChatExample", "PairExample", "PromptExample", "Row",
    "SFTExample", "UnpairedExample", "collate_pairs", "collate_prompts", "collate_sft", "collate_shared_pairs", "load_rows",
    "mismatched_rows", "parse_data_split", "parse_pairs", "parse_prompts", "parse_sft", "parse_unpaired",
    "split_indices", "take_split", "tokenize_pairs", "tokenize_prompts", "tokenize_sft", "tokenize_unpaired",
]
