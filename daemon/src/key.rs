//! The daemon's keys, each its own type so that the compiler tells them apart: a segment's
//! key, an entry's key, and the name a pack job's flight runs under (a segment key once the
//! source's digest is known, a file's flight before). Keys from clients are parsed once, at
//! the edge ([`Key::parse`]); on the wire and in logs each is the same text as before.
#![forbid(unsafe_code)]

use std::fmt;

use crate::source::Digest;

/// Hex digits of a source digest in a key.
const DIGEST_HEX: usize = 64;
/// Hex digits of a plan's hash in a segment key.
const PLAN_HEX: usize = 16;

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A segment's key: `b3:<source digest>@plan:<plan hash>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentKey(String);

impl SegmentKey {
    /// The key of the segment packed from `source` with the canonical plan `plan`.
    pub fn new(source: &Digest, plan: &str) -> Self {
        let p = blake3::hash(plan.as_bytes()).to_hex();
        SegmentKey(format!("b3:{}@plan:{}", source.hex(), &p[..PLAN_HEX]))
    }

    /// `text` if it has a segment key's form.
    pub fn parse(text: &str) -> Option<Self> {
        let (digest, plan) = text.strip_prefix("b3:")?.split_once("@plan:")?;
        (is_hex(digest, DIGEST_HEX) && is_hex(plan, PLAN_HEX)).then(|| SegmentKey(text.to_string()))
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key's text starts with `prefix` (an operator's selection).
    pub fn starts_with(&self, prefix: &str) -> bool {
        self.0.starts_with(prefix)
    }
}

/// An entry's key: `b3:<source digest>/<tensor name>#<layout>@v<layout version>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryKey(String);

impl EntryKey {
    /// The key of tensor `name` of `source` packed with `layout` (its canonical spelling) at
    /// layout version `version`.
    pub fn new(source: &Digest, name: &str, layout: impl fmt::Display, version: u32) -> Self {
        EntryKey(format!("b3:{}/{}#{}@v{}", source.hex(), name, layout, version))
    }

    /// `text` if it has an entry key's form (a digest, then a name; the rest is the entry's).
    pub fn parse(text: &str) -> Option<Self> {
        let (digest, rest) = text.strip_prefix("b3:")?.split_once('/')?;
        (is_hex(digest, DIGEST_HEX) && !rest.is_empty()).then(|| EntryKey(text.to_string()))
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key's text starts with `prefix` (an operator's selection).
    pub fn starts_with(&self, prefix: &str) -> bool {
        self.0.starts_with(prefix)
    }

    /// The hex digest of the entry's source (which segments may hold it).
    pub fn source_hex(&self) -> &str {
        &self.0[3..3 + DIGEST_HEX]
    }
}

/// The flight of a pack job whose source's digest is not known yet: the file, its size and
/// the plan (`file:<size>@plan:<hash>/<device>.<inode>.<times>`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileFlight(String);

impl FileFlight {
    /// The flight of a file of `size` bytes packed with the canonical plan `plan`; `file`
    /// names the file (device, inode, times).
    pub fn new(size: u64, plan: &str, file: &str) -> Self {
        FileFlight(format!("{}{file}", Self::siblings(size, plan)))
    }

    /// The prefix every file flight of this size and plan starts with: its siblings (files
    /// that may hold the same bytes).
    pub fn siblings(size: u64, plan: &str) -> String {
        let p = blake3::hash(plan.as_bytes()).to_hex();
        format!("file:{size}@plan:{}/", &p[..PLAN_HEX])
    }

    /// The flight's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What a pack job's flight runs under.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FlightKey {
    /// The segment it makes (the source's digest is known).
    Segment(SegmentKey),
    /// The file it reads (the digest is learned by the job).
    File(FileFlight),
}

impl FlightKey {
    /// The flight's text (a memfd's name, a log line).
    pub fn as_str(&self) -> &str {
        match self {
            FlightKey::Segment(k) => k.as_str(),
            FlightKey::File(f) => f.as_str(),
        }
    }
}

/// A key a client or an operator names: a segment's or an entry's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// A segment key.
    Segment(SegmentKey),
    /// An entry key.
    Entry(EntryKey),
}

impl Key {
    /// `text` as a segment key or an entry key; `None` if it is neither (nothing can have
    /// that key).
    pub fn parse(text: &str) -> Option<Self> {
        SegmentKey::parse(text).map(Key::Segment).or_else(|| EntryKey::parse(text).map(Key::Entry))
    }
}

macro_rules! text {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}
text!(SegmentKey, EntryKey, FileFlight, FlightKey);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_their_text_and_parse_only_their_own_form() {
        let d = Digest([0xab; 32]);
        let seg = SegmentKey::new(&d, "plan");
        assert_eq!(SegmentKey::parse(seg.as_str()), Some(seg.clone()));
        assert_eq!(EntryKey::parse(seg.as_str()), None);
        let entry = EntryKey::new(&d, "w.weight", "identity", 1);
        assert_eq!(entry.as_str(), format!("b3:{}/w.weight#identity@v1", d.hex()));
        assert_eq!(EntryKey::parse(entry.as_str()), Some(entry.clone()));
        assert_eq!(SegmentKey::parse(entry.as_str()), None);
        assert_eq!(entry.source_hex(), d.hex());
        assert_eq!(Key::parse(seg.as_str()), Some(Key::Segment(seg)));
        assert_eq!(Key::parse(entry.as_str()), Some(Key::Entry(entry)));
        for bad in ["", "b3:", "b3:nope", "b3:nothing@plan:0", "file:1@plan:0/1.2", &format!("b3:{}", d.hex())] {
            assert_eq!(Key::parse(bad), None, "{bad}");
        }
        let flight = FileFlight::new(10, "plan", "1.2.3");
        assert!(flight.as_str().starts_with(&FileFlight::siblings(10, "plan")));
    }
}
