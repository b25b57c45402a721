//! The `ferry.v1` gRPC API, generated at build time from `proto/ferry/v1`.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("ferry.v1");
}

/// The encoded `FileDescriptorSet` of every Ferry proto, for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ferry_v1_descriptor");

#[cfg(test)]
mod tests {
    use prost::Message;

    /// Reflection serves the files under the names other generators use:
    /// relative to `proto/`, so `import "ferry/v1/dlq.proto"` resolves.
    #[test]
    fn descriptor_files_are_named_from_the_proto_root() {
        let set = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET)
            .expect("the embedded descriptor set decodes");
        let ours: Vec<&str> = set
            .file
            .iter()
            .filter_map(|f| f.name.as_deref())
            .filter(|name| !name.starts_with("google/"))
            .collect();
        assert_eq!(ours.len(), 6, "{ours:?}");
        for name in ours {
            assert!(name.starts_with("ferry/v1/"), "{name}");
        }
    }
}
