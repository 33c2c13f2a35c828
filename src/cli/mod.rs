pub mod predict;
pub mod train;
