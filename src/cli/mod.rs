pub mod train;
