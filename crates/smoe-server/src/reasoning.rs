//! Qwen3-style thinking: text up to `</think>` is the model's reasoning, returned apart as
//! `reasoning_content` (as OpenAI-compatible servers for reasoning models do), not as the answer.

/// Splits `text` into (reasoning, answer). The opening `<think>` may be in the output or already
/// in the prompt (templates that open the block for the model), so the closing tag decides.
pub fn split_reasoning(text: &str) -> (Option<String>, String) {
    let Some(end) = text.find("</think>") else {
        return (None, text.to_string());
    };
    let before = text[..end].trim_start();
    let reasoning = before.strip_prefix("<think>").unwrap_or(before).trim();
    let answer = text[end + "</think>".len()..].trim_start();
    (
        (!reasoning.is_empty()).then(|| reasoning.to_string()),
        answer.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::split_reasoning;

    #[test]
    fn splits_thinking_from_the_answer() {
        assert_eq!(
            split_reasoning("<think>\nadd them\n</think>\n\n4"),
            (Some("add them".into()), "4".into())
        );
        // The template opened the block; the output only closes it.
        assert_eq!(
            split_reasoning("hmm.</think>Yes."),
            (Some("hmm.".into()), "Yes.".into())
        );
        // An empty block (thinking switched off) is no reasoning.
        assert_eq!(
            split_reasoning("<think>\n\n</think>\n\nHi"),
            (None, "Hi".into())
        );
        assert_eq!(split_reasoning("plain"), (None, "plain".into()));
    }
}
