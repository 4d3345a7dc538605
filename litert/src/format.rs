//! The file LiteRT's XNNPACK delegate writes as its weight cache, as far as packd reads it:
//! a 32-byte header (`version`, `buffer_list_offset`, `buffer_list_size`, `stale`, little
//! endian), the packed buffers, and at `buffer_list_offset` a flatbuffer indexing them that
//! runs to the end of the file. LiteRT loads a file only when its header has the version it
//! writes, is not stale, and the flatbuffer's size is the rest of the file exactly.
//!
//! packd serves whole pages: [`pad`] grows a built file to a multiple of the page size with
//! zeros and says so in `buffer_list_size`. LiteRT's loader verifies the flatbuffer over
//! that size, which trailing zeros pass (the flatbuffer's offsets all point before them).

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The header version packd knows (`XNNPackCacheHeader::kVersion` of LiteRT 2.3).
pub const VERSION: u64 = 4;
/// The header's size in the file.
pub const HEADER_BYTES: usize = 32;
/// Where `buffer_list_size` lies in the header.
const SIZE_AT: u64 = 16;

/// A cache file's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u64,
    pub buffer_list_offset: u64,
    pub buffer_list_size: u64,
    pub stale: bool,
}

/// Why a file is not a cache packd can serve.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("the cache file is {size} bytes, shorter than its header")]
    Short { size: u64 },
    #[error("the cache file has header version {found}; packd knows version {VERSION}")]
    Version { found: u64 },
    #[error("LiteRT marked the cache file stale")]
    Stale,
    #[error("the cache file's buffer list ({offset} + {len} bytes) does not end where the file does ({size} bytes)")]
    Layout { offset: u64, len: u64, size: u64 },
    #[error("reading or padding the cache file failed: {0}")]
    Io(#[from] std::io::Error),
}

impl Header {
    /// Reads the header of `file`, and checks it describes the whole file as LiteRT's
    /// loader does.
    pub fn read(file: &File) -> Result<Self, FormatError> {
        let size = file.metadata()?.len();
        if size < HEADER_BYTES as u64 {
            return Err(FormatError::Short { size });
        }
        let mut b = [0u8; HEADER_BYTES];
        file.read_exact_at(&mut b, 0)?;
        let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let h = Self { version: word(0), buffer_list_offset: word(1), buffer_list_size: word(2), stale: b[24] != 0 };
        h.check(size)?;
        Ok(h)
    }

    /// Whether LiteRT would load a file of `size` bytes with this header.
    pub fn check(&self, size: u64) -> Result<(), FormatError> {
        if self.version != VERSION {
            return Err(FormatError::Version { found: self.version });
        }
        if self.stale {
            return Err(FormatError::Stale);
        }
        let (offset, len) = (self.buffer_list_offset, self.buffer_list_size);
        if offset < HEADER_BYTES as u64 || offset >= size || offset.checked_add(len) != Some(size) {
            return Err(FormatError::Layout { offset, len, size });
        }
        Ok(())
    }
}

/// Grows `file` (a cache whose `header` was read from it) to a multiple of `page` bytes
/// with zeros and writes the buffer list's new size into its header. Returns the new size.
pub fn pad(file: &File, header: &Header, page: u64) -> Result<u64, FormatError> {
    let size = header.buffer_list_offset + header.buffer_list_size;
    let padded = size.next_multiple_of(page.max(1));
    if padded != size {
        file.set_len(padded)?;
        file.write_all_at(&(padded - header.buffer_list_offset).to_le_bytes(), SIZE_AT)?;
    }
    Ok(padded)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(version: u64, offset: u64, len: u64, stale: u8) -> Vec<u8> {
        let mut b = Vec::new();
        for w in [version, offset, len] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.push(stale);
        b.resize(HEADER_BYTES, 0);
        b
    }

    fn file_with(bytes: &[u8]) -> File {
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f
    }

    #[test]
    fn a_built_file_is_padded_to_whole_pages_and_its_header_says_so() {
        let mut bytes = header(VERSION, 128, 72, 0);
        bytes.resize(200, 0xab);
        let f = file_with(&bytes);
        let h = Header::read(&f).unwrap();
        assert_eq!((h.buffer_list_offset, h.buffer_list_size), (128, 72));
        assert_eq!(pad(&f, &h, 4096).unwrap(), 4096);
        assert_eq!(f.metadata().unwrap().len(), 4096);
        let again = Header::read(&f).unwrap();
        assert_eq!(again.buffer_list_size, 4096 - 128);
        let mut rest = vec![0u8; 4096];
        f.read_exact_at(&mut rest, 0).unwrap();
        assert!(rest[32..200].iter().all(|&b| b == 0xab) && rest[200..].iter().all(|&b| b == 0));
        // A file already a page multiple is left as it is.
        assert_eq!(pad(&f, &again, 4096).unwrap(), 4096);
        assert_eq!(Header::read(&f).unwrap(), again);
    }

    #[test]
    fn files_litert_would_not_load_are_refused_with_the_reason() {
        let cases: [(Vec<u8>, &str); 5] = [
            (header(VERSION, 64, 100, 0)[..20].to_vec(), "shorter than its header"),
            (
                {
                    let mut b = header(3, 64, 36, 0);
                    b.resize(100, 0);
                    b
                },
                "header version 3",
            ),
            (
                {
                    let mut b = header(VERSION, 64, 36, 1);
                    b.resize(100, 0);
                    b
                },
                "stale",
            ),
            (
                {
                    let mut b = header(VERSION, 64, 40, 0);
                    b.resize(100, 0);
                    b
                },
                "does not end where the file does",
            ),
            (
                {
                    let mut b = header(VERSION, 8, 92, 0);
                    b.resize(100, 0);
                    b
                },
                "does not end where the file does",
            ),
        ];
        for (bytes, want) in cases {
            let err = Header::read(&file_with(&bytes)).unwrap_err().to_string();
            assert!(err.contains(want), "{err} (wanted {want})");
        }
    }
}
