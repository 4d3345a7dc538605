//! Why the store refuses bytes or a lease: the budget ([`BudgetError`]) or a per-uid quota
//! ([`QuotaError`], which also carries a budget refusal). Both the budget and the quotas
//! raise them; neither module depends on the other's errors.

/// A new segment does not fit in the budget, even after evicting what can be evicted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "a new segment of {needed} bytes does not fit in the budget of {budget} bytes: {resident} bytes are \
     resident ({held}), {reserved} reserved by running pack jobs and publications, {lent} lent to \
     builders that have not published yet; release or unpin segments, or raise the budget (SetBudget, \
     --max-bytes)"
)]
pub struct BudgetError {
    /// Bytes the new segment needs.
    pub needed: u64,
    /// The budget.
    pub budget: u64,
    /// Bytes of segments in the index.
    pub resident: u64,
    /// Bytes reserved by pack jobs and publications in flight.
    pub reserved: u64,
    /// Bytes lent to builders (claimed: those not claimed give their room back first).
    pub lent: u64,
    /// What holds the resident bytes (leased or pinned segments).
    pub held: String,
}

/// A request over one of its uid's quotas.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    /// `limits.max_leases_per_uid`.
    #[error("uid {uid} holds {held} leases, its quota (limits.max_leases_per_uid); release segments it no longer maps")]
    Leases {
        /// The uid.
        uid: u32,
        /// Leases it holds.
        held: u64,
    },
    /// `limits.max_packed_bytes_per_uid`.
    #[error(
        "a new segment of {needed} bytes would take uid {uid} over its quota of {quota} bytes of packed \
         segments (limits.max_packed_bytes_per_uid); it has {used} bytes in the index or being packed"
    )]
    PackedBytes {
        /// The uid.
        uid: u32,
        /// Bytes the new segment needs.
        needed: u64,
        /// Bytes of segments in the index, and reserved by running jobs, packed for the uid.
        used: u64,
        /// The quota.
        quota: u64,
    },
    /// The budget (see [`BudgetError`]).
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// `limits.max_segments`, with every segment leased or pinned.
    #[error(
        "the index holds {held} leased or pinned segments and {reserved} being made, its limit of {max} \
         (limits.max_segments: each segment is an open fd); release or unpin segments, or raise the limit"
    )]
    Segments {
        /// The limit.
        max: usize,
        /// Segments that cannot be evicted.
        held: usize,
        /// Segments being made.
        reserved: usize,
    },
}
