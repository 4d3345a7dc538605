//! The one safetensors writer of the tests and benchmarks: synthetic models with names
//! escaped as JSON, tensors in the order given.

use std::io::Write;
use std::path::Path;

/// The head of a safetensors file: the header's length, then its JSON (padded with spaces
/// to 8 bytes) describing `tensors` — name, dtype, shape and `[start, end)` in the data
/// that follows the head — in the order given.
pub fn head<N: AsRef<str>, S: AsRef<[u64]>>(
    tensors: impl IntoIterator<Item = (N, &'static str, S, [u64; 2])>,
) -> Vec<u8> {
    let mut header = b"{".to_vec();
    for (i, (name, dtype, shape, [start, end])) in tensors.into_iter().enumerate() {
        if i > 0 {
            header.push(b',');
        }
        let name = serde_json::to_string(name.as_ref()).expect("a string is JSON");
        let entry =
            format!("{name}:{{\"dtype\":\"{dtype}\",\"shape\":{:?},\"data_offsets\":[{start},{end}]}}", shape.as_ref());
        header.extend_from_slice(entry.as_bytes());
    }
    header.push(b'}');
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut head = (header.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&header);
    head
}

/// A safetensors file under construction.
#[derive(Default)]
pub struct SafeTensors {
    tensors: Vec<(String, &'static str, Vec<u64>, Vec<u8>)>,
}

impl SafeTensors {
    /// Adds a tensor with raw little-endian bytes.
    pub fn add(mut self, name: &str, dtype: &'static str, shape: &[u64], bytes: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dtype, shape.to_vec(), bytes));
        self
    }

    /// Adds an f32 tensor.
    pub fn f32(self, name: &str, shape: &[u64], values: &[f32]) -> Self {
        self.add(name, "F32", shape, f32_bytes(values))
    }

    /// The file's bytes: head (tensors in insertion order), then data.
    pub fn bytes(&self) -> Vec<u8> {
        let mut off = 0u64;
        let ranges: Vec<[u64; 2]> = self
            .tensors
            .iter()
            .map(|(_, _, _, b)| {
                off += b.len() as u64;
                [off - b.len() as u64, off]
            })
            .collect();
        let mut out = head(self.tensors.iter().zip(ranges).map(|((n, d, s, _), r)| (n, *d, s, r)));
        for (_, _, _, bytes) in &self.tensors {
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) {
        std::fs::File::create(path).and_then(|mut f| f.write_all(&self.bytes())).expect("write safetensors");
    }
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped_and_order_kept() {
        let bytes = SafeTensors::default().add("z\"q", "U8", &[2], vec![1, 2]).add("a\\b", "U8", &[1], vec![3]).bytes();
        let n = usize::try_from(u64::from_le_bytes(bytes[..8].try_into().unwrap())).unwrap();
        assert_eq!(n % 8, 0);
        let json = std::str::from_utf8(&bytes[8..8 + n]).unwrap().trim_end();
        assert_eq!(
            json,
            r#"{"z\"q":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a\\b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}"#
        );
        assert_eq!(&bytes[8 + n..], &[1, 2, 3]);
    }
}
