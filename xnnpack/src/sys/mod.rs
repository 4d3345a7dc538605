//! The raw parts of adoption: the process's loaded objects and their GOT slots ([`got`]),
//! and the functions put in those slots and the provider XNNPACK calls back ([`hooks`]).

pub(crate) mod got;
pub(crate) mod hooks;
