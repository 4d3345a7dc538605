//! A strict safetensors header parser over untrusted bytes.
//!
//! It validates everything before any tensor byte is touched: header size bound, UTF-8
//! JSON object without duplicate keys or unknown fields, known dtypes, shapes whose element
//! count does not overflow, `dtype × shape = byte length`, and offsets that cover the data
//! region exactly (in range, no overlap, no hole, no trailing bytes). It never panics on
//! any input (fuzzed). What it keeps is proportional to the header: per tensor its name,
//! dtype and at most [`MAX_RANK`] dimensions; `__metadata__` is checked entry by entry and
//! kept nowhere; duplicate names are found by sorting references, not by copying names.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};

use super::Dtype;
use super::error::{HeaderError, SourceError};

/// Largest accepted JSON header, in bytes (the reference implementation's bound).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One tensor of a safetensors file, with its absolute byte range in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name as written in the header.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a scalar.
    pub shape: Vec<u64>,
    /// Absolute file offset of the first byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A validated header: tensors sorted by file offset, tiling the data region exactly.
#[derive(Clone, Debug)]
pub struct Header {
    /// Length of the JSON header (the file's first 8 bytes, little endian).
    pub json_len: u64,
    /// File offset where the data region starts (8 + json_len).
    pub data_start: u64,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

/// Reads the 8-byte little-endian header length and checks it against the file size.
pub fn header_len(prefix: &[u8], file_len: u64) -> Result<u64, SourceError> {
    if file_len < 8 || prefix.len() < 8 {
        return Err(HeaderError::Short { file_len }.into());
    }
    let mut le = [0u8; 8];
    le.copy_from_slice(&prefix[..8]);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER_BYTES {
        return Err(HeaderError::LengthOverLimit { n, limit: MAX_HEADER_BYTES }.into());
    }
    if n < 2 {
        return Err(HeaderError::LengthTooShort { n }.into());
    }
    if 8 + n > file_len {
        return Err(HeaderError::LengthPastEnd { n, file_len }.into());
    }
    Ok(n)
}

/// Parses and validates the JSON header `json` of a file of `file_len` bytes.
pub fn parse_header(json: &[u8], file_len: u64) -> Result<Header, SourceError> {
    let json_len = json.len() as u64;
    let data_start = 8 + json_len;
    let data_len = file_len.checked_sub(data_start).ok_or(HeaderError::DoesNotFit { json_len, file_len })?;
    let text = std::str::from_utf8(json).map_err(HeaderError::NotUtf8)?;
    let raw: RawHeader = serde_json::from_str(text).map_err(HeaderError::NotJson)?;

    let mut tensors = Vec::with_capacity(raw.0.len());
    for (name, t) in raw.0 {
        let Ok(dtype) = t.dtype.parse::<Dtype>() else {
            return Err(HeaderError::Dtype { name, dtype: t.dtype }.into());
        };
        let numel = t.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let Some(bits) = numel.and_then(|n| n.checked_mul(dtype.bits())) else {
            return Err(HeaderError::ShapeOverflows { name, shape: t.shape }.into());
        };
        if bits % 8 != 0 {
            return Err(HeaderError::PartBytes { name, numel: numel.unwrap_or(0), dtype }.into());
        }
        let [begin, end] = t.data_offsets;
        if begin > end {
            return Err(HeaderError::Reversed { name, begin, end }.into());
        }
        if end > data_len {
            return Err(HeaderError::OutOfRange { name, begin, end, data_len }.into());
        }
        if end - begin != bits / 8 {
            return Err(HeaderError::WrongSize { name, dtype, shape: t.shape, needs: bits / 8, begin, end }.into());
        }
        tensors.push(TensorInfo { name, dtype, shape: t.shape, start: data_start + begin, len: end - begin });
    }
    tensors.sort_by_key(|t| (t.start, t.len));

    let mut cursor = data_start;
    for (i, t) in tensors.iter().enumerate() {
        if t.start < cursor {
            let prev = tensors[i - 1].name.clone();
            return Err(HeaderError::Overlaps { name: t.name.clone(), prev }.into());
        }
        if t.start > cursor {
            return Err(HeaderError::Hole { name: t.name.clone(), bytes: t.start - cursor }.into());
        }
        cursor = t.start + t.len;
    }
    if cursor != file_len {
        return Err(HeaderError::Trailing { bytes: file_len - cursor }.into());
    }
    Ok(Header { json_len, data_start, tensors })
}

/// Most dimensions a tensor's shape may have (real models use at most 5 or 6). Bounds what
/// a shape costs: without it `[0,0,0,…]` would cost 8 bytes per 2 bytes of JSON.
pub const MAX_RANK: usize = 16;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    dtype: String,
    #[serde(deserialize_with = "bounded_shape")]
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// A shape of at most [`MAX_RANK`] dimensions, refused as soon as it has one more.
fn bounded_shape<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<u64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a list of at most {MAX_RANK} dimensions")
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            let mut dims = Vec::new();
            while let Some(d) = seq.next_element::<u64>()? {
                if dims.len() == MAX_RANK {
                    return Err(de::Error::custom(format!("shape has more than {MAX_RANK} dimensions")));
                }
                dims.push(d);
            }
            Ok(dims)
        }
    }
    d.deserialize_seq(V)
}

/// `__metadata__`: an object of strings, checked entry by entry and kept nowhere (it
/// costs the largest entry, not all of them).
struct Metadata;

impl<'de> serde::Deserialize<'de> for Metadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Metadata;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Metadata, A::Error> {
                while map.next_entry::<String, String>()?.is_some() {}
                Ok(Metadata)
            }
        }
        d.deserialize_map(V)
    }
}

/// The header object: tensors in document order; `__metadata__` checked and dropped.
struct RawHeader(Vec<(String, RawTensor)>);

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut metadata = false;
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if std::mem::replace(&mut metadata, true) {
                            return Err(de::Error::custom(format!("duplicate key {key:?}")));
                        }
                        let _: Metadata = map.next_value()?;
                    } else {
                        let t: RawTensor =
                            map.next_value().map_err(|e| de::Error::custom(format!("tensor {key}: {e}")))?;
                        out.push((key, t));
                    }
                }
                // Duplicates found by sorting references, not by a set of copied names.
                let mut names: Vec<&str> = out.iter().map(|(k, _)| k.as_str()).collect();
                names.sort_unstable();
                if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                    return Err(de::Error::custom(format!("duplicate key {:?}", w[0])));
                }
                Ok(RawHeader(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    fn file(json: &str, data: usize) -> (Vec<u8>, u64) {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.resize(v.len() + data, 0);
        let n = v.len() as u64;
        (v, n)
    }

    fn parse(json: &str, data: usize) -> Result<Header, SourceError> {
        let (v, n) = file(json, data);
        let len = header_len(&v, n)?;
        parse_header(&v[8..8 + len as usize], n)
    }

    #[test]
    fn accepts_valid_and_sorts_by_offset() {
        let h = parse(
            r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[2],"data_offsets":[8,24]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            24,
        )
        .unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(h.tensors[1].dtype, Dtype::I64);
        assert_eq!(h.tensors[0].start, h.data_start);
    }

    #[test]
    fn shapes_have_at_most_max_rank_dimensions_and_metadata_only_strings() {
        let shape = |rank: usize| {
            let dims = vec!["1"; rank].join(",");
            format!(r#"{{"a":{{"dtype":"U8","shape":[{dims}],"data_offsets":[0,1]}}}}"#)
        };
        assert_eq!(parse(&shape(MAX_RANK), 1).unwrap().tensors[0].shape.len(), MAX_RANK);
        let err = parse(&shape(MAX_RANK + 1), 1).unwrap_err().to_string();
        assert!(err.contains("more than 16 dimensions") && err.contains("tensor a"), "{err}");
        let meta = r#"{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(parse(meta, 1).is_err(), "metadata values are strings");
        let twice = r#"{"__metadata__":{},"__metadata__":{},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(parse(twice, 1).unwrap_err().to_string().contains("duplicate key"));
        let dup = r#"{"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[0],"data_offsets":[1,1]},"b":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}"#;
        assert!(parse(dup, 1).unwrap_err().to_string().contains("duplicate key \"b\""));
    }

    #[test]
    fn rejects_each_lie() {
        let cases = [
            (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4, "needs 8 bytes"),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}"#,
                6,
                "overlaps",
            ),
            (r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 8, "end of the file"),
            (r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, 8, "holes"),
            (r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,400]}}"#, 4, "out of range"),
            (r#"{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}}"#, 4, "unknown dtype"),
            (r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#, 4, "overflows"),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "duplicate",
            ),
            (r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}"#, 4, "unknown field"),
            (r#"[1,2]"#, 0, "JSON object"),
            (r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#, 2, "whole bytes"),
        ];
        for (json, data, want) in cases {
            let err = parse(json, data).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
    }

    #[test]
    fn rejects_bad_lengths() {
        assert!(header_len(&[1, 2, 3], 3).unwrap_err().to_string().contains("shorter"));
        let mut v = u64::MAX.to_le_bytes().to_vec();
        v.push(b'{');
        assert!(header_len(&v, 9).unwrap_err().to_string().contains("limit"));
        let v = 1000u64.to_le_bytes();
        assert!(header_len(&v, 100).unwrap_err().to_string().contains("beyond the end"));
    }
}

#[cfg(test)]
mod robustness {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Arbitrary bytes never panic the parser (cargo-fuzz target `safetensors_header`
        /// explores further).
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let len = data.len() as u64;
            if let Ok(n) = header_len(&data, len)
                && let Some(json) = data.get(8..8 + usize::try_from(n).unwrap_or(usize::MAX))
            {
                let _ = parse_header(json, len);
            }
        }

        /// Plausible headers with random numbers: accepted ones tile the file exactly.
        #[test]
        fn accepted_headers_tile_the_file(
            dims in proptest::collection::vec((0u64..5, 0u64..5, 0u64..40, 0u64..40), 1..4),
            extra in 0u64..16,
        ) {
            let mut json = String::from("{");
            for (i, (a, b, s, e)) in dims.iter().enumerate() {
                if i > 0 { json.push(','); }
                json.push_str(&format!(r#""t{i}":{{"dtype":"U8","shape":[{a},{b}],"data_offsets":[{s},{e}]}}"#));
            }
            json.push('}');
            let file_len = 8 + json.len() as u64 + extra;
            if let Ok(h) = parse_header(json.as_bytes(), file_len) {
                let mut cursor = h.data_start;
                for t in &h.tensors {
                    prop_assert_eq!(t.start, cursor);
                    cursor += t.len;
                }
                prop_assert_eq!(cursor, file_len);
            }
        }
    }
}
