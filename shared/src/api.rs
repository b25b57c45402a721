//! The `ferry.v1` gRPC API, generated at build time from `proto/ferry/v1`.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("ferry.v1");
}

/// The encoded `FileDescriptorSet` of every Ferry proto, for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ferry_v1_descriptor");
