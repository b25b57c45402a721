//! The SQS and SNS transports end to end, against the shared moto server and Mosquitto brokers
//! started by the tests.

mod sns;
mod sqs;
mod support;
mod throughput;
