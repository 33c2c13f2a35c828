//! The kernel source units. Each op family's kernels (`ops/<family>.cu`, next to the Rust module
//! that launches them) are compiled with `ops/prelude.cuh` in front as one NVRTC program, loaded
//! as one module and cached as one entry: an edit to a family recompiles that family only (an
//! edit to the prelude recompiles all of them).

/// Compiles the prelude and one family's source into a unit.
macro_rules! unit {
    ($family:literal) => {
        (concat!("ptl-kernels-", $family), concat!(include_str!("ops/prelude.cuh"), include_str!(concat!("ops/", $family, ".cu"))))
    };
}

/// Every unit as (module name, source), in the order kernels are looked up.
pub(crate) const UNITS: [(&str, &str); 12] = [
    unit!("elementwise"),
    unit!("reduce"),
    unit!("index"),
    unit!("pool"),
    unit!("norm"),
    unit!("softmax"),
    unit!("multi_tensor"),
    unit!("pack"),
    unit!("rng"),
    unit!("depthwise"),
    unit!("thin_conv"),
    unit!("narrow_wgrad"),
];

/// The call every kernel body opens with (`ops/prelude.cuh`: programmatic dependent launch).
pub(crate) const ENTRY_CALL: &str = "ptl_kernel_entry();";

/// [`UNITS`] as compiled: every kernel's body opens with [`ENTRY_CALL`] ([`with_entry_waits`]).
pub(crate) fn compiled_units() -> Vec<(&'static str, String)> {
    UNITS.iter().map(|&(name, source)| (name, with_entry_waits(source))).collect()
}

/// `source` with [`ENTRY_CALL`] right after the opening brace of every `__global__` function
/// definition (declarations and mentions in `//` comments are left alone). Done when the unit is
/// assembled rather than written into each kernel, so that no kernel can miss it: a kernel
/// launched with the programmatic-serialization attribute but without the wait could read its
/// predecessor's output before it is written.
pub(crate) fn with_entry_waits(source: &str) -> String {
    const KEY: &str = "__global__";
    let mut out = String::with_capacity(source.len() + 4096);
    let mut done = 0;
    for (at, _) in source.match_indices(KEY) {
        let line_start = source[..at].rfind('\n').map_or(0, |i| i + 1);
        if at < done || source[line_start..at].contains("//") {
            continue;
        }
        let mut depth = 0i32;
        for (i, c) in source[at + KEY.len()..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ';' if depth == 0 => break,
                '{' if depth == 0 => {
                    let body = at + KEY.len() + i + 1;
                    out.push_str(&source[done..body]);
                    out.push_str(ENTRY_CALL);
                    done = body;
                    break;
                }
                _ => {}
            }
        }
    }
    out.push_str(&source[done..]);
    out
}

#[cfg(test)]
mod tests {
    use super::{with_entry_waits, ENTRY_CALL, UNITS};

    /// The launchers, in the order of [`UNITS`].
    const LAUNCHERS: [(&str, &str); 12] = [
        ("elementwise", include_str!("ops/elementwise.rs")),
        ("reduce", include_str!("ops/reduce.rs")),
        ("index", include_str!("ops/index.rs")),
        ("pool", include_str!("ops/pool.rs")),
        ("norm", concat!(include_str!("ops/norm.rs"), include_str!("ops/norm_cl.rs"))),
        ("softmax", include_str!("ops/softmax.rs")),
        ("multi_tensor", include_str!("ops/multi_tensor.rs")),
        ("pack", include_str!("ops/pack.rs")),
        ("rng", include_str!("ops/rng.rs")),
        ("depthwise", include_str!("ops/depthwise.rs")),
        ("thin_conv", include_str!("ops/thin_conv.rs")),
        ("narrow_wgrad", include_str!("ops/narrow_wgrad.rs")),
    ];

    /// The literal kernel names a launcher passes to `func(` (first argument; both arms of an
    /// `if … { "a" } else { "b" }`). Names built at run time are not seen.
    fn launched_names(rust: &str) -> Vec<String> {
        let mut names = Vec::new();
        for (at, _) in rust.match_indices(".func(") {
            let args = &rust[at + ".func(".len()..];
            let (mut depth, mut end) = (0i32, args.len());
            for (i, c) in args.char_indices() {
                match c {
                    '(' | '{' => depth += 1,
                    ')' | '}' if depth > 0 => depth -= 1,
                    ')' | ',' if depth == 0 => {
                        end = i;
                        break;
                    }
                    _ => {}
                }
            }
            names.extend(args[..end].split('"').skip(1).step_by(2).filter(|s| !s.is_empty()).map(str::to_string));
        }
        names
    }

    /// Whether `source` defines a kernel named `base` or `base_<suffix>` (directly or via a macro;
    /// a vectorised `x_v` is pasted from `x##sfx`).
    fn defines(source: &str, base: &str) -> bool {
        if let Some(unvectorised) = base.strip_suffix("_v") {
            if defines(source, unvectorised) && source.contains(&format!("{unvectorised}##sfx")) {
                return true;
            }
        }
        source.match_indices(base).any(|(i, _)| {
            let before = source[..i].trim_end();
            let after = source[i + base.len()..].chars().next();
            let declared = before.ends_with("void")
                || (before.ends_with(')') && before[before.len().saturating_sub(30)..].contains("__launch_bounds__"));
            declared && matches!(after, Some('(' | '_' | '#'))
        })
    }

    #[test]
    fn every_family_defines_the_kernels_its_launcher_names() {
        for ((family, rust), (module, source)) in LAUNCHERS.iter().zip(UNITS) {
            assert_eq!(*module, format!("ptl-kernels-{family}"), "UNITS and LAUNCHERS in the same order");
            let names = launched_names(rust);
            assert!(!names.is_empty() || *family == "pack", "{family}.rs launches no literal kernel name");
            for name in names {
                assert!(defines(source, &name), "{family}.rs launches `{name}`, which {family}.cu does not define");
            }
        }
    }

    #[test]
    fn the_check_sees_a_misplaced_kernel() {
        let softmax = UNITS[5].1;
        assert!(defines(softmax, "softmax_rows"));
        assert!(!defines(softmax, "bn_eval"), "bn_eval belongs to norm.cu");
        assert_eq!(launched_names(r#"dev.func(if v { "a" } else { "b_v" }, sfx(x))?; dev.func("c", "u8")"#), ["a", "b_v", "c"]);
    }

    #[test]
    fn units_have_distinct_names_and_kernels() {
        for (i, (name, source)) in UNITS.iter().enumerate() {
            assert!(UNITS[..i].iter().all(|(other, _)| other != name), "{name} twice");
            assert!(source.contains("extern \"C\" __global__"), "{name} defines no kernel");
        }
    }

    #[test]
    fn every_kernel_body_opens_with_the_entry_wait() {
        for (name, source) in UNITS {
            let compiled = with_entry_waits(source);
            let kernels = source.lines().filter(|l| l.contains("__global__") && !l.trim_start().starts_with("//")).count();
            assert!(kernels > 0, "{name}");
            assert_eq!(compiled.matches(ENTRY_CALL).count(), kernels, "{name}: one entry wait per kernel");
            for (at, _) in compiled.match_indices(ENTRY_CALL) {
                let before = compiled[..at].trim_end();
                assert!(before.ends_with('{'), "{name}: the wait opens a body");
                let head = &compiled[before.rfind("__global__").unwrap_or(0)..at];
                assert!(!head.contains(';'), "{name}: the wait is the first statement of its kernel: {head}");
            }
            assert_eq!(compiled.replace(ENTRY_CALL, ""), source, "{name}: nothing else changes");
        }
    }

    #[test]
    fn the_entry_wait_skips_declarations_comments_and_handles_macros() {
        let src = "// __global__ void not_this() {}\n\
                   extern \"C\" __global__ void decl(int a);\n\
                   extern \"C\" __global__ void __launch_bounds__(256) k(const float* x, int n) { if (n) { x++; } }\n\
                   #define INST(n) extern \"C\" __global__ void n(int a) \\\n  { f(a); }\n";
        let out = with_entry_waits(src);
        assert_eq!(out.matches(ENTRY_CALL).count(), 2, "{out}");
        assert!(out.contains(&format!("int n) {{{ENTRY_CALL} if (n)")), "{out}");
        assert!(out.contains(&format!("{{{ENTRY_CALL} f(a); }}")), "{out}");
        assert!(out.contains("void decl(int a);\n"), "{out}");
    }
}
