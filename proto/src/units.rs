//! Byte counts as people write them (`8GiB`, `500M`, `1048576`), parsed one way for the
//! daemon's flags and config file and for `packctl`.

/// A text that is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// No leading digits.
    #[error("{0:?} is not a byte count (e.g. 8GiB, 500M, 1048576)")]
    NotANumber(String),
    /// A unit other than K, M, G or T.
    #[error("{0:?}: unknown unit (use K, M, G or T)")]
    Unit(String),
    /// A fraction of a byte (`1.5` without a unit).
    #[error("{0:?}: a decimal number needs a unit (e.g. 1.5G); bytes are whole")]
    Fraction(String),
    /// More than `u64::MAX` bytes.
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// Parses a byte count: a number with an optional K, M, G or T suffix (powers of 1024,
/// optionally followed by "iB" or "B"; any case). A decimal number takes a unit (`1.5G`)
/// and is rounded down to whole bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let (whole, fraction) = num.split_once('.').unwrap_or((num, ""));
    let not_a_number = || SizeError::NotANumber(text.to_string());
    if whole.is_empty() || fraction.contains('.') || (num.contains('.') && fraction.is_empty()) {
        return Err(not_a_number());
    }
    let n: u64 = whole.parse().map_err(|_| not_a_number())?;
    let unit = unit.trim().to_ascii_uppercase();
    let shift = match unit.trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(SizeError::Unit(text.to_string())),
    };
    let bytes = n.checked_mul(1u64 << shift).ok_or_else(|| SizeError::Overflow(text.to_string()))?;
    if fraction.is_empty() {
        return Ok(bytes);
    }
    if shift == 0 {
        return Err(SizeError::Fraction(text.to_string()));
    }
    // The fraction's share of the unit, rounded down: at most 19 digits count (u128 math).
    let digits = &fraction[..fraction.len().min(19)];
    let f = digits.parse::<u128>().map_err(|_| not_a_number())?;
    let scale = digits.bytes().fold(1u128, |scale, _| scale * 10);
    let part = u64::try_from((f << shift) / scale).map_err(|_| SizeError::Overflow(text.to_string()))?;
    bytes.checked_add(part).ok_or_else(|| SizeError::Overflow(text.to_string()))
}

/// A byte count as people read it: `10 bytes`, `512.0 KiB`, `8.0 GiB` (powers of 1024, one
/// decimal).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_powers_of_1024_and_bad_text_is_named() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size(" 8GiB "), Ok(8 << 30));
        assert_eq!(parse_size("500M"), Ok(500 << 20));
        assert_eq!(parse_size("3kb"), Ok(3 << 10));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("lots"), Err(SizeError::NotANumber("lots".into())));
        assert_eq!(parse_size("3 parsecs"), Err(SizeError::Unit("3 parsecs".into())));
        assert_eq!(parse_size("99999999999T"), Err(SizeError::Overflow("99999999999T".into())));
        // Decimals take a unit and round down to whole bytes.
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0.25 MiB"), Ok(1 << 18));
        assert_eq!(parse_size("1.0000000001K"), Ok(1024));
        assert_eq!(parse_size("2.5"), Err(SizeError::Fraction("2.5".into())));
        for bad in ["1.", ".5G", "1.2.3G", "."] {
            assert_eq!(parse_size(bad), Err(SizeError::NotANumber(bad.into())), "{bad}");
        }
    }

    #[test]
    fn sizes_print_in_the_largest_unit_below_them() {
        assert_eq!(format_size(10), "10 bytes");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(format_size(90 << 20), "90.0 MiB");
        assert_eq!(format_size(8 << 30), "8.0 GiB");
        assert_eq!(format_size(3 << 50), "3072.0 TiB");
    }
}
