//! Any bytes as a `.safetensors` checkpoint: opening must return an error or a model, never panic,
//! and a model that opens must upscale a tiny image.
#![no_main]

#[path = "open.rs"]
mod open;

libfuzzer_sys::fuzz_target!(|data: &[u8]| open::open_and_run(data, "safetensors"));
