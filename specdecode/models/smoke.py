"""The smoke experiment's in-process stand-ins, seeded and built in milliseconds (`load_model("smoke")`):
a tiny random target and a byte-level tokenizer, so a training job runs in seconds with no hub."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

_SPECIALS = ("<s>", "</s>", "<unk>")


def smoke_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (3 specials + 256 bytes, no merges): any text, no hub, 259 ids."""
    vocab = {token: i for i, token in enumerate(_SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


def smoke_target(seed: int = 0, num_layers: int = 4) -> LlamaForCausalLM:
    """A 64-wide random Llama over `smoke_tokenizer`'s ids, fp32, eval mode; initializer_range 0.5
    makes a derived drafter start with low acceptance that training can visibly raise."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(_SPECIALS) + 256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return LlamaForCausalLM(config).eval()
