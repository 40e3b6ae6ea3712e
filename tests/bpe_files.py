"""GPT-2 BPE files (vocab.json, merges.txt) and a HuggingFace tokenizer.json, written by a byte-level BPE
tokenizer trained here on the committed test corpus: real tokenizer files, no download."""

import json
import os

CORPUS_JSONL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "corpus", "corpus.jsonl")


def write_bpe_files(folder: str, vocab_size: int = 400) -> dict:
    """{"vocab": path, "merges": path, "tokenizer_json": path}; <|endoftext|> is a special token, as in GPT-2."""
    from tokenizers import ByteLevelBPETokenizer

    with open(CORPUS_JSONL) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    os.makedirs(folder, exist_ok=True)
    vocab, merges = tokenizer.save_model(folder)
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    tokenizer.save(tokenizer_json)
    return {"vocab": vocab, "merges": merges, "tokenizer_json": tokenizer_json}


def write_sentencepiece_model(folder: str, vocab_size: int = 300) -> str:
    """A Llama-2 style SentencePiece BPE model (unk 0, bos 1, eos 2) trained on the test corpus; its path."""
    import sentencepiece

    os.makedirs(folder, exist_ok=True)
    text = os.path.join(folder, "corpus.txt")
    with open(CORPUS_JSONL) as f, open(text, "w") as out:
        out.writelines(json.loads(line)["text"].replace("\n", " ") + "\n" for line in f if line.strip())
    prefix = os.path.join(folder, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        input=text,
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return prefix + ".model"
