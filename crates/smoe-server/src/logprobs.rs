//! Log-probabilities in OpenAI's two shapes (chat: `content[]` with bytes; completions: parallel
//! arrays), with each token's exact bytes: decoding a lone byte-level BPE piece would give U+FFFD
//! for a part of a character.

use crate::scheduler::TokenOut;
use serde_json::{json, Map, Value};
use smoe_engine::tokenizer::Tokenizer;

/// A token's bytes: byte-level BPE pieces (GPT-2's byte↔unicode map, used by Qwen, Llama 3,
/// Mixtral's successors) mapped back to bytes; other vocabularies (SentencePiece) decoded.
pub fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(piece) = tok.id_to_token(id) else {
        return vec![];
    };
    let bytes: Option<Vec<u8>> = piece.chars().map(unicode_to_byte).collect();
    match bytes {
        Some(b) => b,
        None => tok
            .decode(&[id], false)
            .map(String::into_bytes)
            .unwrap_or_else(|_| piece.into_bytes()),
    }
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the other 68
/// bytes were shifted to U+0100.. in order.
fn unicode_to_byte(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let cp = c as u32;
    if printable(cp) {
        return Some(cp as u8);
    }
    let n = cp.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn entry(tok: &Tokenizer, id: u32, logprob: f32) -> Map<String, Value> {
    let bytes = token_bytes(tok, id);
    let mut m = Map::new();
    m.insert("token".into(), json!(String::from_utf8_lossy(&bytes)));
    m.insert("logprob".into(), json!(finite(logprob)));
    m.insert("bytes".into(), json!(bytes));
    m
}

/// JSON has no -inf; OpenAI reports -9999.0 for impossible tokens.
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// One element of a chat `logprobs.content` array.
pub fn chat_entry(tok: &Tokenizer, t: &TokenOut) -> Value {
    let mut m = entry(tok, t.id, t.logprob);
    let top: Vec<Value> = t
        .top
        .iter()
        .map(|&(id, lp)| Value::Object(entry(tok, id, lp)))
        .collect();
    m.insert("top_logprobs".into(), Value::Array(top));
    Value::Object(m)
}

/// Text-completion logprobs for `tokens`, whose text starts at `offset` characters.
#[derive(Default)]
pub struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl CompletionLogprobs {
    pub fn push(&mut self, tok: &Tokenizer, t: &TokenOut, offset: usize) {
        let text = String::from_utf8_lossy(&token_bytes(tok, t.id)).into_owned();
        self.tokens.push(json!(text));
        self.token_logprobs.push(json!(finite(t.logprob)));
        let mut top = Map::new();
        for &(id, lp) in &t.top {
            let s = String::from_utf8_lossy(&token_bytes(tok, id)).into_owned();
            top.insert(s, json!(finite(lp)));
        }
        self.top.push(Value::Object(top));
        self.offsets.push(offset);
    }

    pub fn take_json(&mut self) -> Value {
        let v = json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        });
        *self = Self::default();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::unicode_to_byte;

    #[test]
    fn byte_level_map_round_trips() {
        assert_eq!(unicode_to_byte('a'), Some(b'a'));
        assert_eq!(unicode_to_byte('Ġ'), Some(b' ')); // U+0120
        assert_eq!(unicode_to_byte('Ċ'), Some(b'\n')); // U+010A
        assert_eq!(unicode_to_byte('\u{0100}'), Some(0));
        assert_eq!(unicode_to_byte('▁'), None);
    }
}
