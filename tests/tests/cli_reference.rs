//! `docs/cli-reference.md` is what the built `ptl` prints — its `--help` pages and `ptl cfg`'s key
//! list — so the reference cannot drift from the code: a change of a key, a default or a help text
//! fails this test until the file is regenerated (`PTL_BLESS=1 cargo test -p ptl-tests --test
//! cli_reference` writes it).

mod common;

use std::path::Path;

use common::{ptl, text};

/// The pages of the reference: a heading and the arguments that print it.
const PAGES: [(&str, &[&str]); 9] = [
    ("ptl", &["--help"]),
    ("ptl train", &["train", "--help"]),
    ("ptl train keys (`ptl cfg`)", &["cfg"]),
    ("ptl val", &["val", "--help"]),
    ("ptl predict", &["predict", "--help"]),
    ("ptl export", &["export", "--help"]),
    ("ptl data", &["data", "--help"]),
    ("ptl data synth", &["data", "synth", "--help"]),
    ("ptl cfg", &["cfg", "--help"]),
];

/// The reference as the binary prints it now (the test binary's name read as `ptl`).
fn reference(cwd: &Path) -> String {
    let mut md = String::from(
        "# ptl command-line reference\n\n\
         What `ptl` prints for each command's `--help` and for `ptl cfg` (every `key=value` setting of\n\
         `ptl train` with its default and meaning). Generated from the binary by the\n\
         `cli_reference` test, which fails when this file and the binary disagree; regenerate with\n\
         `PTL_BLESS=1 cargo test -p ptl-tests --test cli_reference`. How the settings work together:\n\
         [user-guide.md](user-guide.md).\n",
    );
    for (title, args) in PAGES {
        let o = ptl(args, cwd);
        assert!(o.status.success(), "ptl {args:?}: {}", text(&o));
        let page = String::from_utf8_lossy(&o.stdout).replace("ptl-ext", "ptl");
        md.push_str(&format!("\n## {title}\n\n```text\n{}\n```\n", page.trim_end()));
    }
    md
}

#[test]
fn the_cli_reference_is_what_ptl_prints() {
    let cwd = std::env::temp_dir().join(format!("ptl-cli-reference-{}", std::process::id()));
    std::fs::create_dir_all(&cwd).expect("scratch folder");
    let now = reference(&cwd);
    let _ = std::fs::remove_dir_all(&cwd);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cli-reference.md");
    if std::env::var_os("PTL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &now).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        println!("wrote {}", path.display());
        return;
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_default();
    if kept != now {
        let first = kept.lines().zip(now.lines()).position(|(a, b)| a != b).unwrap_or(kept.lines().count().min(now.lines().count()));
        panic!(
            "docs/cli-reference.md differs from what ptl prints (first at line {}: kept {:?}, now {:?}); regenerate it with \
             PTL_BLESS=1 cargo test -p ptl-tests --test cli_reference",
            first + 1,
            kept.lines().nth(first),
            now.lines().nth(first)
        );
    }
}
