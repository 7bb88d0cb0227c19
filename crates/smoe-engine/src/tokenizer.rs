//! Text <-> token ids, on top of the Hugging Face `tokenizers` crate.
//!
//! A model file stores its `tokenizer.json` verbatim, so we load it with the
//! same library transformers uses: that is the only way to get bit-identical
//! pre-tokenization, merges and special-token handling for every model family.
//!
//! [`StreamDecoder`] exists because decoding token by token is wrong for
//! byte-level BPE: one character (é, 中, an emoji) may be split across several
//! tokens, and decoding a lone piece yields U+FFFD. The stream decoder holds
//! text back until it is complete.

use std::sync::Arc;

/// The error type of the text side of the engine (tokenizer, chat template,
/// sampler configuration). Messages are meant to be shown to a user as-is.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The model's tokenizer.json could not be parsed.
    #[error("cannot load the model's tokenizer (tokenizer.json): {0}")]
    TokenizerLoad(String),
    /// The tokenizer failed on some input text.
    #[error("cannot tokenize the text: {0}")]
    Encode(String),
    /// Token ids could not be turned back into text (e.g. an id out of range).
    #[error("cannot decode token ids to text: {0}")]
    Decode(String),
    /// The chat template does not compile.
    #[error("the chat template has a syntax error{}: {message}", at_line(*.line))]
    TemplateSyntax {
        /// 1-based line in the template source, when known.
        line: Option<usize>,
        message: String,
    },
    /// Rendering the chat template failed (including `raise_exception(...)`
    /// from the template itself, whose message is passed through).
    #[error("the chat template failed to render{}: {message}", at_line(*.line))]
    TemplateRender {
        line: Option<usize>,
        message: String,
    },
    /// A sampler setting is out of range.
    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// A loaded tokenizer. Cheap to clone (the inner tokenizer is shared), so a
/// [`StreamDecoder`] can own a handle and outlive borrows in a server loop.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Tokenizer {
    /// Builds a tokenizer from the text of a `tokenizer.json` file.
    pub fn from_json(json: &str) -> Result<Self, TextError> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| TextError::TokenizerLoad(format!("{e}")))?;
        // Highest id + 1 rather than the number of entries: ids can have gaps
        // and added tokens may reuse base ids; callers size logit buffers and
        // validate ids with this. Computed once because get_vocab is O(vocab).
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        Ok(Tokenizer {
            inner: Arc::new(inner),
            vocab_size,
        })
    }

    /// Tokenizes `text`. `add_special_tokens` runs the tokenizer's
    /// post-processor (e.g. adds BOS); leave it off for text that was already
    /// rendered by a chat template, which writes its special tokens itself.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Encode(format!("{e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Turns ids back into text. Invalid UTF-8 byte sequences become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TextError::Decode(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.vocab_size
            )));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Decode(format!("{e}")))
    }

    /// Id of a token given its exact vocabulary string (e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary string of an id, if the id exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Highest token id + 1, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A fresh incremental decoder sharing this tokenizer.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }
}

/// Turns a stream of ids into text deltas.
///
/// Same scheme as text-generation-inference / `tokenizers::DecodeStream`:
/// decode a small window of ids twice, once without and once with the newest
/// ids, and emit the difference. The window keeps a little left context
/// because decoders are context-sensitive (byte-level pieces, Metaspace's
/// leading-space stripping). Text is only emitted when the window does not
/// end in U+FFFD, i.e. no character is half-received; [`finish`](Self::finish)
/// flushes whatever is left (a genuinely invalid tail then shows as U+FFFD,
/// exactly as a full `decode` would). Memory stays bounded by the window.
#[derive(Debug)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special_tokens: bool,
    /// Only the ids still needed: `ids[..read]` is already-emitted context,
    /// `ids[read..]` is pending.
    ids: Vec<u32>,
    read: usize,
}

impl StreamDecoder {
    pub fn new(tok: Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special_tokens,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Feeds one id; returns the newly completed text, if any.
    ///
    /// Ids past the tokenizer's vocabulary (models pad their embedding beyond it, and a sampler
    /// can land there) have no text: they are skipped rather than failing the generation.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TextError> {
        if id as usize >= self.tok.vocab_size() {
            return Ok(None);
        }
        self.ids.push(id);
        let prefix = self
            .tok
            .decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let full = self.tok.decode(&self.ids, self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            // Nothing new yet, or a character is still incomplete.
            return Ok(None);
        }
        let delta = split_after_common_prefix(&prefix, &full).to_string();
        // Keep the just-emitted ids as left context for the next window.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(Some(delta))
    }

    /// Flushes the text of ids that were held back (an incomplete character
    /// at the end of generation). Resets the decoder.
    pub fn finish(&mut self) -> Result<String, TextError> {
        let prefix = self
            .tok
            .decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let full = self.tok.decode(&self.ids, self.skip_special_tokens)?;
        self.ids.clear();
        self.read = 0;
        Ok(split_after_common_prefix(&prefix, &full).to_string())
    }
}

/// The part of `full` after what `prefix` already covered. Normally `full`
/// starts with `prefix`; if a decoder rewrote earlier text we fall back to the
/// longest common prefix so that we never panic or repeat text.
fn split_after_common_prefix<'a>(prefix: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let mut cut = 0;
    for ((i, a), b) in full.char_indices().zip(prefix.chars()) {
        if a != b {
            break;
        }
        cut = i + a.len_utf8();
    }
    &full[cut..]
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = include_str!("../tests/data/tiny_bytelevel_tokenizer.json");

    fn tok() -> Tokenizer {
        Tokenizer::from_json(TINY).expect("tiny tokenizer loads")
    }

    #[test]
    fn loads_and_reports_vocab() {
        let t = tok();
        // 256 bytes + 10 merges + 3 added special tokens.
        assert_eq!(t.vocab_size(), 269);
        assert_eq!(t.token_to_id("<|im_end|>"), Some(268));
        assert_eq!(t.token_to_id("hello"), Some(259));
        assert_eq!(t.token_to_id("no-such-token"), None);
        assert_eq!(t.id_to_token(266).as_deref(), Some("<s>"));
    }

    #[test]
    fn bad_json_is_an_error() {
        let err = Tokenizer::from_json("{not json").unwrap_err();
        assert!(matches!(err, TextError::TokenizerLoad(_)));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn merges_apply_and_special_tokens_are_added_on_request() {
        let t = tok();
        let plain = t.encode("hello world", false).unwrap();
        assert_eq!(plain, vec![259, 264]); // "hello", "Ġworld"
        let with_bos = t.encode("hello world", true).unwrap();
        assert_eq!(with_bos, vec![266, 259, 264]);
        // Special tokens in the text are recognised as single tokens.
        let ids = t.encode("<|im_start|>hello<|im_end|>", false).unwrap();
        assert_eq!(ids, vec![267, 259, 268]);
        assert_eq!(t.decode(&ids, true).unwrap(), "hello");
        assert_eq!(
            t.decode(&ids, false).unwrap(),
            "<|im_start|>hello<|im_end|>"
        );
    }

    #[test]
    fn round_trip_multibyte() {
        let t = tok();
        for text in [
            "café au lait",
            "中文 text",
            "emoji 🦀🎉!",
            "é",
            "mixed\n\tws  é中🦀",
        ] {
            let ids = t.encode(text, false).unwrap();
            assert_eq!(t.decode(&ids, false).unwrap(), text, "ids {ids:?}");
        }
        // 'é' is one merged token; '中' is three byte tokens.
        assert_eq!(t.encode("é", false).unwrap().len(), 1);
        assert_eq!(t.encode("中", false).unwrap().len(), 3);
    }

    #[test]
    fn decode_rejects_out_of_range_ids() {
        let err = tok().decode(&[1, 5000], false).unwrap_err();
        assert!(err.to_string().contains("5000"), "{err}");
    }

    fn stream(t: &Tokenizer, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut d = t.stream_decoder(skip);
        let mut deltas = Vec::new();
        for &id in ids {
            if let Some(s) = d.step(id).unwrap() {
                deltas.push(s);
            }
        }
        (deltas, d.finish().unwrap())
    }

    #[test]
    fn stream_decoder_matches_full_decode_and_never_splits_chars() {
        let t = tok();
        let text = "hello 中文 world 🦀 café, 🎉🎉 done";
        let ids = t.encode(text, false).unwrap();
        assert!(ids.len() > text.chars().count() / 2);
        let (deltas, tail) = stream(&t, &ids, false);
        for d in &deltas {
            assert!(!d.contains('\u{FFFD}'), "partial char emitted: {deltas:?}");
        }
        assert_eq!(tail, "");
        assert_eq!(deltas.concat(), t.decode(&ids, false).unwrap());
        assert_eq!(deltas.concat(), text);
        // The crab (4 byte tokens) arrives as one delta, not 4.
        assert!(deltas.iter().any(|d| d.contains('🦀')));
    }

    #[test]
    fn stream_decoder_with_special_tokens() {
        let t = tok();
        let ids = t.encode("<|im_start|>中 hello<|im_end|>", false).unwrap();
        for skip in [false, true] {
            let (deltas, tail) = stream(&t, &ids, skip);
            assert_eq!(deltas.concat() + &tail, t.decode(&ids, skip).unwrap());
        }
    }

    #[test]
    fn stream_decoder_flushes_incomplete_tail() {
        let t = tok();
        let mut ids = t.encode("ok 🦀", false).unwrap();
        ids.pop(); // cut the crab's last byte
        let (deltas, tail) = stream(&t, &ids, false);
        assert_eq!(deltas.concat(), "ok ");
        assert!(
            !tail.is_empty() && tail.chars().all(|c| c == '\u{FFFD}'),
            "{tail:?}"
        );
        assert_eq!(deltas.concat() + &tail, t.decode(&ids, false).unwrap());
    }

    #[test]
    fn common_prefix_fallback() {
        assert_eq!(split_after_common_prefix("abc", "abcdef"), "def");
        assert_eq!(split_after_common_prefix("abX", "abcdef"), "cdef");
        assert_eq!(split_after_common_prefix("é", "éa"), "a");
    }
}
