//! The command line's logger: what the library crates log through the `log` facade goes to
//! stderr, one message a line, as written (they carry their own `ptl:` or `AutoBatch:` prefix).
//! `-q` keeps warnings and errors only, `-v` adds debug messages, `-vv` trace.

use std::io::Write;

use log::{LevelFilter, Log, Metadata, Record};

struct Stderr;

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            let _ = writeln!(std::io::stderr().lock(), "{}", record.args());
        }
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// The level `-q` / `-v` (counted) select: info by default.
pub fn level(quiet: bool, verbose: u8) -> LevelFilter {
    match (quiet, verbose) {
        (true, _) => LevelFilter::Warn,
        (false, 0) => LevelFilter::Info,
        (false, 1) => LevelFilter::Debug,
        _ => LevelFilter::Trace,
    }
}

/// Installs the stderr logger at `level` (once per process; a later call only sets the level).
pub fn install(level: LevelFilter) {
    static LOGGER: Stderr = Stderr;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(level);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_and_verbose_pick_the_level() {
        assert_eq!(level(false, 0), LevelFilter::Info);
        assert_eq!(level(true, 2), LevelFilter::Warn);
        assert_eq!(level(false, 1), LevelFilter::Debug);
        assert_eq!(level(false, 3), LevelFilter::Trace);
    }
}
