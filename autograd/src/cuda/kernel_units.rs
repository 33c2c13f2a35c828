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

#[cfg(test)]
mod tests {
    use super::UNITS;

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
}
