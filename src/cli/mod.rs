pub mod export;
pub mod predict;
pub mod train;
