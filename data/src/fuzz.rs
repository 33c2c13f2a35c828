//! Entry points for fuzzing the parsers that read user files, and a small mutation harness that
//! runs them on stable Rust (CI's smoke run; `fuzz/` drives the same entry points with libFuzzer).
//!
//! Each target must return normally for every input — `Err` is fine, a panic or an abort is a
//! bug. None of them writes files or prints.

use std::path::Path;

use crate::labels::{KptShape, LabelRules};

/// The fuzzed parsers.
pub const TARGETS: [&str; 4] = ["labels", "dataset_yaml", "coco_json", "image_header"];

/// YOLO pose label text (17 keypoints with visibility, one class).
pub fn labels(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let rules = LabelRules { kpt_shape: KptShape::COCO, nc: 1, single_cls: false };
    let _ = crate::labels::parse_label_text(&text, Path::new("fuzz.txt"), &rules);
    let rules2 = LabelRules { kpt_shape: KptShape { k: 5, d: 2 }, nc: 3, single_cls: true };
    let _ = crate::labels::parse_label_text(&text, Path::new("fuzz.txt"), &rules2);
}

/// Dataset yaml text (paths resolved against a folder that does not exist).
pub fn dataset_yaml(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = crate::config::DatasetConfig::parse(&text, Path::new("/nonexistent/ptl-fuzz/data.yaml"));
}

/// COCO keypoints JSON text.
pub fn coco_json(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = crate::coco::convert_coco_counted(&text, Path::new("fuzz.json"), 17);
}

/// Image bytes: format detection, the header size check and decoding (bounded allocations).
pub fn image_header(data: &[u8]) {
    let _ = crate::image::decode_bytes(data, Path::new("fuzz.img"));
}

/// The entry point of target `name`.
pub fn target(name: &str) -> Option<fn(&[u8])> {
    match name {
        "labels" => Some(labels),
        "dataset_yaml" => Some(dataset_yaml),
        "coco_json" => Some(coco_json),
        "image_header" => Some(image_header),
        _ => None,
    }
}

/// Tokens the mutator splices in, per target: numbers at the edges, separators, keywords.
fn dictionary(name: &str) -> &'static [&'static [u8]] {
    match name {
        "labels" => &[b"nan", b"inf", b"-inf", b"1e39", b"-0", b"1.01", b"2", b"7", b" ", b"\n", b"\t", b"0.5 ", b"\xEF\xBB\xBF"],
        "dataset_yaml" => &[
            b"kpt_shape: [17, 3]\n",
            b"flip_idx: [",
            b"names:",
            b"nc: ",
            b"train: ",
            b"val: ",
            b"path: ",
            b"train_images: ",
            b"- ",
            b"{",
            b"}",
            b"[",
            b"]",
            b": ",
            b"\n  ",
            b"&a ",
            b"*a",
            b"!!binary ",
            b"18446744073709551616",
        ],
        "coco_json" => &[
            b"\"images\"",
            b"\"annotations\"",
            b"\"keypoints\"",
            b"\"bbox\"",
            b"\"iscrowd\"",
            b"\"image_id\"",
            b"\"width\"",
            b"1e309",
            b"-1",
            b"null",
            b"[]",
            b"{}",
            b",",
            b":",
            b"18446744073709551615",
        ],
        _ => {
            &[b"\xFF\xD8\xFF\xC0", b"\x89PNG\r\n\x1a\n", b"IHDR", b"IDAT", b"IEND", b"\xFF\xFF", b"\x00\x00", b"\xFF\xD9", b"Exif\x00\x00"]
        }
    }
}

/// A tiny xorshift generator (the harness must not depend on the crate's own RNG streams).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `input` (bit flips, interesting bytes, inserts, deletes, duplications,
/// dictionary tokens, splices with another corpus entry, truncation).
fn mutate(input: &mut Vec<u8>, rng: &mut XorShift, dict: &[&[u8]], other: &[u8]) {
    let len = input.len();
    match rng.below(9) {
        0 if len > 0 => {
            let i = rng.below(len);
            input[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            input[i] = [0u8, 0xFF, 0x7F, 0x80, b'0', b'9', b'-', b'.'][rng.below(8)];
        }
        2 => {
            let i = rng.below(len + 1);
            input.insert(i, rng.next() as u8);
        }
        3 if len > 0 => {
            let i = rng.below(len);
            let n = rng.below((len - i).min(64)) + 1;
            input.drain(i..i + n);
        }
        4 if len > 0 => {
            let i = rng.below(len);
            let n = rng.below((len - i).min(64)) + 1;
            let chunk: Vec<u8> = input[i..i + n].to_vec();
            let at = rng.below(len + 1);
            input.splice(at..at, chunk);
        }
        5 | 6 if !dict.is_empty() => {
            let tok = dict[rng.below(dict.len())];
            let at = rng.below(len + 1);
            if rng.below(2) == 0 && at + tok.len() <= len {
                input[at..at + tok.len()].copy_from_slice(tok);
            } else {
                input.splice(at..at, tok.iter().copied());
            }
        }
        7 if !other.is_empty() => {
            let at = rng.below(len + 1);
            let from = rng.below(other.len());
            let n = rng.below(other.len() - from) + 1;
            input.truncate(at);
            input.extend_from_slice(&other[from..from + n]);
        }
        _ if len > 0 => input.truncate(rng.below(len)),
        _ => input.push(rng.next() as u8),
    }
    input.truncate(1 << 16);
}

/// What a harness run did.
#[derive(Clone, Debug, Default)]
pub struct FuzzRun {
    pub executions: u64,
    /// Inputs that made the target panic (the first few kept).
    pub crashes: Vec<Vec<u8>>,
    pub crash_count: u64,
}

/// Runs target `name` on every corpus entry, then `executions` mutated inputs (1–8 stacked
/// mutations of a random corpus entry, fixed `seed`), catching panics.
pub fn run(name: &str, corpus: &[Vec<u8>], executions: u64, seed: u64) -> Option<FuzzRun> {
    let f = target(name)?;
    Some(run_with(f, dictionary(name), corpus, executions, seed))
}

/// [`run`] for any function (tests of the harness itself), with a generic dictionary.
pub fn run_fn(f: fn(&[u8]), corpus: &[Vec<u8>], executions: u64, seed: u64) -> FuzzRun {
    run_with(f, &[b"!", b"0", b" "], corpus, executions, seed)
}

fn run_with(f: fn(&[u8]), dict: &[&[u8]], corpus: &[Vec<u8>], executions: u64, seed: u64) -> FuzzRun {
    let mut rng = XorShift(seed | 1);
    let mut out = FuzzRun::default();
    let exec = |input: &[u8], out: &mut FuzzRun| {
        out.executions += 1;
        if std::panic::catch_unwind(|| f(input)).is_err() {
            out.crash_count += 1;
            if out.crashes.len() < 8 {
                out.crashes.push(input.to_vec());
            }
        }
    };
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for c in corpus {
        exec(c, &mut out);
    }
    let empty: Vec<u8> = Vec::new();
    for _ in 0..executions {
        let base = if corpus.is_empty() { &empty } else { &corpus[rng.below(corpus.len())] };
        let other = if corpus.is_empty() { &empty } else { &corpus[rng.below(corpus.len())] };
        let mut input = base.clone();
        for _ in 0..rng.below(8) + 1 {
            mutate(&mut input, &mut rng, dict, other);
        }
        exec(&input, &mut out);
    }
    std::panic::set_hook(hook);
    out
}
