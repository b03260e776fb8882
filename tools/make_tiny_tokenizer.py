#!/usr/bin/env python3
"""Rebuilds tests/fixtures/tiny-tokenizer/ (a 320-id byte-level BPE trained on the public-domain text
tests/fixtures/text/alice-ch1.txt, EOS <|endoftext|>), so the data tests need no model hub.

    python3 tools/make_tiny_tokenizer.py"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

here = os.path.dirname(os.path.abspath(__file__))
fix = os.path.join(here, "..", "tests", "fixtures")
out = os.path.join(fix, "tiny-tokenizer")
os.makedirs(out, exist_ok=True)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_start|>", "<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train([os.path.join(fix, "text", "alice-ch1.txt")], trainer)
tok.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|endoftext|>", "model_max_length": 4096}, f, indent=2)
    f.write("\n")
print(f"wrote {out}: vocab {tok.get_vocab_size()}, eos id {tok.token_to_id('<|endoftext|>')}")
