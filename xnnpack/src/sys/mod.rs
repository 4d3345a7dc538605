//! Where this crate's `unsafe` lives (with the provider's own block handling in `cache`):
//! the address-space reservation handed to XNNPACK ([`vm`]), libraries held by handle
//! ([`dl`]), the process's loaded objects and their GOT slots ([`got`]), and the functions
//! put in those slots with the provider XNNPACK calls back ([`hooks`]).

pub(crate) mod dl;
pub(crate) mod got;
pub(crate) mod hooks;
pub(crate) mod vm;
