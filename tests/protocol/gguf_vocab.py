"""Write a tokenizer into a GGUF file the way llama.cpp's conversion lays it out (keys, token types, merges as
"left right" strings, padding ids as [PADn]), from a `tokenizers` byte-level BPE or a SentencePiece model."""

import json

import gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (int(t) for t in (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
    gguf.TokenType.UNUSED, gguf.TokenType.BYTE))


def add_byte_level_vocab(w: gguf.GGUFWriter, tokenizer, pre: str, *, bos: str | None = None, eos: str | None = None,
                         add_bos: bool | None = None, vocab_size: int | None = None) -> None:
    """tokenizer: a tokenizers.Tokenizer (byte-level BPE). Added special tokens are control tokens, other added
    tokens user-defined (stored as the text they decode to); ids the tokenizer lacks up to vocab_size are unused."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size or len(vocab)):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            special = added[i].special
            text = by_id[i] if special else tokenizer.decode(tokenizer.encode(by_id[i], add_special_tokens=False).ids)
            tokens.append(text)
            types.append(CONTROL if special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]])
    if bos is not None:
        w.add_bos_token_id(vocab[bos])
    if eos is not None:
        w.add_eos_token_id(vocab[eos])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)


def add_sentencepiece_vocab(w: gguf.GGUFWriter, sp, control: tuple[str, ...] = (),
                            add_space_prefix: bool | None = None) -> None:
    """sp: a sentencepiece.SentencePieceProcessor; control: its user-defined pieces that the model's tokenizer
    config marks special (Gemma's <start_of_turn>), written as control tokens."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        kind = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) or piece in control
                else UNUSED if sp.is_unused(i) else BYTE if sp.is_byte(i) else NORMAL)
        types.append(kind)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_pad_token_id(sp.pad_id())
    w.add_add_bos_token(True)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)


def write_gguf_file(path, arch: str, add_vocab, chat_template: str | None = None) -> None:
    """A GGUF file holding only metadata: the architecture, what add_vocab(writer) writes, a chat template."""
    w = gguf.GGUFWriter(str(path), arch)
    add_vocab(w)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
