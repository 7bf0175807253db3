"""Train the demo tokenizer shipped as compiled_engine/models/demo_tokenizer/tokenizer.model (run
once, by hand).

Corpus: the Python standard library's top-level sources plus Debian's license texts. The shipped
file, not this script, is what makes the demo model byte-identical everywhere.
"""

import glob
import io
import os
import sysconfig

import sentencepiece as spm

OUT = os.path.join(
    os.path.dirname(__file__),
    "..",
    "compiled_engine",
    "models",
    "demo_tokenizer",
    "tokenizer.model",
)


def main() -> None:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    files += sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f))
    lines = []
    for f in files:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            lines.extend(line.rstrip("\n") for line in fh if line.strip())
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=8000, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
        split_digits=True, add_dummy_prefix=False, allow_whitespace_only_pieces=True, num_threads=1,
        user_defined_symbols=["<|system|>", "<|user|>", "<|assistant|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=0, character_coverage=1.0,
        max_sentence_length=100000, minloglevel=2,
    )
    with open(OUT, "wb") as fh:
        fh.write(model.getvalue())


if __name__ == "__main__":
    main()
