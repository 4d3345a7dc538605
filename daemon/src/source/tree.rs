//! BLAKE3 on every core: the input split along BLAKE3's own tree (`blake3::hazmat`), each
//! subtree hashed on a thread of its own, the chaining values merged up to the root. The
//! result is the BLAKE3 of the whole input, bit for bit (tests compare with
//! `blake3::hash` across odd lengths).
//!
//! A subtree smaller than [`LEAF`] is hashed on one thread: BLAKE3 already runs 16 chunks
//! at once with AVX-512 inside one thread, and a thread costs tens of microseconds.

use blake3::Hasher;
use blake3::hazmat::{ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root};

/// Smallest subtree worth a thread of its own.
pub const LEAF: u64 = 4 << 20;
/// Bytes read per call while hashing a subtree.
const READ: usize = 128 << 10;

/// Adds bytes `[offset, offset + len)` of the input to a hasher: the one thing the tree
/// needs to know about where the input lies (a file read in pieces, or memory).
trait Feed<E>: Fn(&mut Hasher, u64, u64) -> Result<(), E> + Sync {}
impl<E, F: Fn(&mut Hasher, u64, u64) -> Result<(), E> + Sync> Feed<E> for F {}

/// The chaining value of the subtree at `offset` of `len` bytes (a valid BLAKE3 subtree:
/// produced by splitting with `left_subtree_len`).
fn subtree<E: Send>(offset: u64, len: u64, threads: usize, feed: &impl Feed<E>) -> Result<ChainingValue, E> {
    if threads <= 1 || len <= LEAF {
        let mut h = Hasher::new();
        h.set_input_offset(offset);
        feed(&mut h, offset, len)?;
        return Ok(h.finalize_non_root());
    }
    let (l, r) = halves(offset, len, threads, feed)?;
    Ok(merge_subtrees_non_root(&l, &r, Mode::Hash))
}

/// How many threads hash the left subtree (`left` of `len` bytes) and how many the right
/// one: in proportion to their bytes, rounded up. BLAKE3's left subtree is the largest
/// power of two of chunks below the length, so the two can be very unequal (16 MiB and
/// 4 KiB; 64 MiB and 27 MiB): the split follows the work. A right part too small for a
/// thread of its own is hashed by the waiting thread; rounding up may run one thread more
/// than `threads`, which the scheduler shares out better than an unequal split.
fn share(threads: usize, left: u64, len: u64) -> (usize, usize) {
    let right = len - left;
    if right <= LEAF || threads <= 1 {
        return (threads.max(1), 1);
    }
    let t = threads as u64;
    let part = |bytes: u64| usize::try_from((t * bytes).div_ceil(len).max(1)).unwrap_or(1);
    (part(left), part(right))
}

/// The chaining values of the two halves of a subtree, the left one on a new thread.
fn halves<E: Send>(
    offset: u64,
    len: u64,
    threads: usize,
    feed: &impl Feed<E>,
) -> Result<(ChainingValue, ChainingValue), E> {
    let left = left_subtree_len(len);
    let (lt, rt) = share(threads, left, len);
    std::thread::scope(|s| {
        let l = std::thread::Builder::new().spawn_scoped(s, || subtree(offset, left, lt, feed));
        let r = subtree(offset + left, len - left, rt, feed);
        let l = match l {
            Ok(handle) => handle.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            // No thread to be had: the left half on this one.
            Err(_) => subtree(offset, left, 1, feed),
        };
        Ok((l?, r?))
    })
}

/// The BLAKE3 of the `len` bytes of input, on up to `threads` threads.
fn root<E: Send>(len: u64, threads: usize, feed: &impl Feed<E>) -> Result<blake3::Hash, E> {
    if threads <= 1 || len <= LEAF {
        let mut h = Hasher::new();
        feed(&mut h, 0, len)?;
        return Ok(h.finalize());
    }
    let (l, r) = halves(0, len, threads, feed)?;
    Ok(merge_subtrees_root(&l, &r, Mode::Hash))
}

/// The BLAKE3 of the `len` bytes that `read(offset, buf)` fills `buf` with, on up to
/// `threads` threads (each reads its own part, in pieces of 1 MiB).
pub fn hash<E: Send>(
    len: u64,
    threads: usize,
    read: impl Fn(u64, &mut [u8]) -> Result<(), E> + Sync,
) -> Result<blake3::Hash, E> {
    let feed = |h: &mut Hasher, offset: u64, len: u64| {
        let mut buf = vec![0u8; usize::try_from(len.min(READ as u64)).unwrap_or(READ)];
        let mut done = 0u64;
        while done < len {
            let n = usize::try_from(len - done).unwrap_or(usize::MAX).min(buf.len());
            read(offset + done, &mut buf[..n])?;
            h.update(&buf[..n]);
            done += n as u64;
        }
        Ok(())
    };
    root(len, threads, &feed)
}

/// Bytes hashed at a time by [`update_ahead`], the next piece being fetched meanwhile.
const AHEAD: usize = 64 << 10;

/// Adds `bytes` to `h`, asking the CPU for each next piece while the current one is
/// hashed. Memory just written elsewhere (a packed segment in 4 KiB pages) is otherwise
/// read at latency, not bandwidth: the hardware prefetcher stops at every page boundary.
fn update_ahead(h: &mut Hasher, bytes: &[u8]) {
    let mut pieces = bytes.chunks(AHEAD).peekable();
    while let Some(piece) = pieces.next() {
        if let Some(next) = pieces.peek() {
            crate::sys::cpu::prefetch(next);
        }
        h.update(piece);
    }
}

/// The BLAKE3 of `bytes`, on up to `threads` threads, hashed where they lie.
pub fn hash_slice(bytes: &[u8], threads: usize) -> blake3::Hash {
    let feed = |h: &mut Hasher, offset: u64, len: u64| {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        update_ahead(h, &bytes[start..start + usize::try_from(len).unwrap_or(usize::MAX)]);
        Ok::<(), std::convert::Infallible>(())
    };
    match root(bytes.len() as u64, threads, &feed) {
        Ok(h) => h,
        Err(never) => match never {},
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data: sizes and byte patterns
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8).collect()
    }

    #[test]
    fn equals_blake3_around_every_boundary() {
        for len in [0, 1, 1023, 1024, 1025, LEAF as usize - 1, LEAF as usize, LEAF as usize + 1, 3 * LEAF as usize + 7]
        {
            let d = data(len, 3);
            let read = |offset: u64, buf: &mut [u8]| -> Result<(), ()> {
                buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
                Ok(())
            };
            for threads in [1, 2, 3, 8] {
                assert_eq!(hash_slice(&d, threads), blake3::hash(&d), "len {len} threads {threads}");
                assert_eq!(hash(len as u64, threads, read), Ok(blake3::hash(&d)), "read, len {len} threads {threads}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        #[test]
        fn equals_blake3_for_odd_lengths(len in 0usize..(20 << 20), threads in 1usize..6, seed in any::<u8>()) {
            let d = data(len, seed);
            prop_assert_eq!(hash_slice(&d, threads), blake3::hash(&d));
        }
    }

    #[test]
    fn a_read_error_is_returned() {
        let err = hash(64 << 20, 4, |offset, _buf: &mut [u8]| if offset > 40 << 20 { Err(offset) } else { Ok(()) });
        assert!(err.is_err());
    }
}
