pub mod draw;
pub mod predict;
pub mod train;
