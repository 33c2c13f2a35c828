//! Numbers as C's printf formats them: what Ultralytics' tables and `results.csv` print.

/// `%.{sig}g` as C formats it (the way Ultralytics' tables print numbers).
pub(crate) fn fmt_g(v: f64, sig: usize) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    if v == 0.0 {
        return "0".into();
    }
    let sig = sig.max(1);
    let exp = v.abs().log10().floor() as i32;
    // Rounding may carry into the next power of ten (9.9996 → 10.00): take the exponent after it.
    let rounded: f64 = format!("{v:.*e}", sig - 1).parse().unwrap_or(v);
    let exp = if rounded != 0.0 { rounded.abs().log10().floor() as i32 } else { exp };
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    if exp < -4 || exp >= sig as i32 {
        let s = format!("{v:.*e}", sig - 1);
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        format!("{}e{}{:02}", trim(mantissa.to_string()), if e < 0 { '-' } else { '+' }, e.abs())
    } else {
        trim(format!("{v:.*}", (sig as i32 - 1 - exp).max(0) as usize))
    }
}

#[cfg(test)]
mod tests {
    /// A results.csv row as Ultralytics writes it: `%.6g` for every value.
    #[test]
    fn results_rows_are_printed_with_g() {
        let row = crate::fit::summary::ResultsCsv::format_row(&[1.0, 1.673609, 101.336479, 0.000315, 0.0, 1e-7]);
        assert_eq!(row, "1,1.67361,101.336,0.000315,0,1e-07");
    }
}
