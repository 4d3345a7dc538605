//! A build under provisional names: the table that turns them into content names.
//!
//! A builder that names its static tensors provisionally (by the file they are mapped from
//! and where, `packd_interpose::memo::Memo::provisional`) packs under those names while the
//! content names are hashed beside it. Before publishing, every entry key is renamed
//! ([`rename_key`]) and the pairs are written into the segment as one more entry,
//! [`TABLE_KEY`] ([`table`]): a worker served through the provisional identity (an alias)
//! reads it ([`parse`]) and looks its weights up under the content names, without hashing.
//! Workers that named by content never look the table up (no XNNPACK key looks like it).

#![forbid(unsafe_code)]

use std::collections::HashMap;

/// The entry holding the table: `p:… c:…` lines.
pub(crate) const TABLE_KEY: &str = "packd:names";

/// The key prefix of an entry whose renamed key another entry has (two provisional names
/// of the same bytes): listed under this and its offset, never looked up.
pub(crate) const DUPLICATE_KEY: &str = "packd:duplicate/";

/// Bytes of one table line.
const LINE: usize = 70;

/// The longest table a worker with `names` provisional names reads: one line each (a
/// longer one is not the builder's of these tensors).
pub(crate) fn table_bound(names: usize) -> usize {
    names.saturating_mul(LINE)
}

/// Whether `n` is a name of `prefix` (`p:` or `c:`) and 32 lower-case hex digits.
fn is_name(n: &str, prefix: &str) -> bool {
    n.len() == 34 && n.starts_with(prefix) && n[2..].bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `key` with every provisional name in it (`p:` and 32 hex digits) that `names` knows
/// replaced by its content name; other text is kept as it is.
pub(crate) fn rename_key(key: &str, names: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(key.len());
    let mut rest = key;
    while let Some(at) = rest.find("p:") {
        out.push_str(&rest[..at]);
        let here = &rest[at..];
        match here.get(..34).filter(|n| is_name(n, "p:")).and_then(|n| names.get(n)) {
            Some(content) => {
                out.push_str(content);
                rest = &here[34..];
            }
            None => {
                out.push_str("p:");
                rest = &here[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The table's bytes: one `PROVISIONAL CONTENT` line per pair, sorted.
pub(crate) fn table(names: &HashMap<String, String>) -> Vec<u8> {
    let mut pairs: Vec<(&String, &String)> = names.iter().collect();
    pairs.sort_unstable();
    pairs.iter().flat_map(|(p, c)| format!("{p} {c}\n").into_bytes()).collect()
}

/// The pairs of a table as [`table`] writes it; lines that are not a provisional and a
/// content name are skipped.
pub(crate) fn parse(bytes: &[u8]) -> HashMap<String, String> {
    let text = String::from_utf8_lossy(bytes);
    text.lines()
        .filter_map(|line| {
            let (p, c) = line.split_once(' ')?;
            (is_name(p, "p:") && is_name(c, "c:")).then(|| (p.to_string(), c.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: u8) -> String {
        format!("p:{}", format!("{n:x}").repeat(32))
    }

    fn c(n: u8) -> String {
        format!("c:{}", format!("{n:x}").repeat(32))
    }

    #[test]
    fn every_known_provisional_name_in_a_key_is_renamed_and_nothing_else() {
        let names: HashMap<String, String> = [(p(1), c(2)), (p(3), c(4))].into_iter().collect();
        let key = format!("s=0000abcd;f=00000012;k={}+64;b={}", p(1), p(3));
        assert_eq!(rename_key(&key, &names), format!("s=0000abcd;f=00000012;k={}+64;b={}", c(2), c(4)));
        // Unknown, short or malformed ones stay.
        let other = format!("s=1;k={};b=p:12;x=p:", p(5));
        assert_eq!(rename_key(&other, &names), other);
        assert_eq!(rename_key(&format!("k={}", p(1)), &names), format!("k={}", c(2)));
        assert_eq!(rename_key("", &names), "");
    }

    #[test]
    fn a_table_reads_back_as_written_and_garbage_is_skipped() {
        let names: HashMap<String, String> = (0..12).map(|i| (p(i), c(15 - i))).collect();
        let bytes = table(&names);
        assert_eq!(bytes.len(), 12 * LINE);
        assert_eq!(table_bound(12), bytes.len());
        assert_eq!(parse(&bytes), names);
        let mut bad = bytes.clone();
        bad.extend_from_slice(format!("{} {}\nnot a line\n{} {}\n\u{0}\u{ff}", c(1), p(1), p(1), p(2)).as_bytes());
        assert_eq!(parse(&bad), names, "a pair in the wrong order, a content name twice, noise");
    }
}
