fn main() {
    println!("ptl {}", env!("CARGO_PKG_VERSION"));
}
