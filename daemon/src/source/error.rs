//! What can be wrong with a source.

use super::digest::Digest;
use packd_kernels::Dtype;

/// Errors about a source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The fd is not something packd reads models from.
    #[error("source fd is {0}, not a regular file")]
    NotAFile(&'static str),
    /// The fd cannot be read.
    #[error("source fd is not readable: {0}")]
    Unreadable(std::io::Error),
    /// The bytes are not a valid safetensors file.
    #[error(transparent)]
    Format(#[from] HeaderError),
    /// The file changed while the daemon read it.
    #[error("source changed while it was read ({0}); pack it again once it is stable")]
    Changed(Change),
    /// Nobody waits for the result any more (every requester left), or the source stopped
    /// answering and its watcher gave up.
    #[error("reading the source was stopped: {0}")]
    Stopped(&'static str),
}

/// How a source was seen to change while it was read.
#[derive(Debug, thiserror::Error)]
pub enum Change {
    #[error("short read of {len} bytes at offset {offset}")]
    ShortRead { len: usize, offset: u64 },
    #[error("size or modification time differs")]
    Stat,
    #[error("digest {got:?}, expected {want:?}")]
    Digest { got: Digest, want: Digest },
}

/// What is wrong with a safetensors header (each says it in words).
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("not a safetensors file: {file_len} bytes is shorter than the 8-byte header length")]
    Short { file_len: u64 },
    #[error(
        "not a safetensors file: its first 8 bytes read as a header length of {n}, above the limit of {limit} bytes"
    )]
    LengthOverLimit { n: u64, limit: u64 },
    #[error("not a safetensors file: its header length {n} is too short for a JSON object")]
    LengthTooShort { n: u64 },
    #[error("header length {n} reaches beyond the end of the {file_len}-byte file (truncated?)")]
    LengthPastEnd { n: u64, file_len: u64 },
    #[error("header of {json_len} bytes does not fit in a {file_len}-byte file")]
    DoesNotFit { json_len: u64, file_len: u64 },
    /// The header is larger than this machine's memory can address.
    #[error("header too large")]
    TooLarge,
    #[error("header is not UTF-8: {0}")]
    NotUtf8(std::str::Utf8Error),
    #[error("header is not a valid safetensors JSON object: {0}")]
    NotJson(serde_json::Error),
    #[error("tensor {name}: unknown dtype {dtype:?}")]
    Dtype { name: String, dtype: String },
    #[error("tensor {name}: shape {shape:?} overflows")]
    ShapeOverflows { name: String, shape: Vec<u64> },
    #[error("tensor {name}: {numel} elements of {dtype} do not fill whole bytes")]
    PartBytes { name: String, numel: u64, dtype: Dtype },
    #[error("tensor {name}: data_offsets [{begin}, {end}] are reversed")]
    Reversed { name: String, begin: u64, end: u64 },
    #[error("tensor {name}: data_offsets [{begin}, {end}] are out of range of the {data_len}-byte data region")]
    OutOfRange { name: String, begin: u64, end: u64, data_len: u64 },
    #[error("tensor {name}: {dtype} × {shape:?} needs {needs} bytes but data_offsets [{begin}, {end}] hold {}", end - begin)]
    WrongSize { name: String, dtype: Dtype, shape: Vec<u64>, needs: u64, begin: u64, end: u64 },
    #[error("tensor {name}: data overlaps tensor {prev}")]
    Overlaps { name: String, prev: String },
    #[error("tensor {name}: {bytes} bytes before it belong to no tensor (holes are not allowed)")]
    Hole { name: String, bytes: u64 },
    #[error("{bytes} bytes at the end of the file belong to no tensor")]
    Trailing { bytes: u64 },
}
