pub mod export;
pub mod predict;
pub mod train;

/// Why a command failed: the message (printed after `error: `) and the process's exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: u8,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { message, code: 1 }
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure { message: message.into(), code: 1 }
    }
}
