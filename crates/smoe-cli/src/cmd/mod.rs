pub mod bench;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod logprobs;
pub mod perplexity;
pub mod profile;
pub mod synth;
