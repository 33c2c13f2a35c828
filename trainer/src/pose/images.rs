//! Images on their way into the model: u8 NCHW pixels uploaded and scaled to f32 in [0, 1] — one
//! conversion for training (with the device HSV jitter), validation and prediction.

use ptl_autograd::{DType, Device, Tensor};

use crate::Result;

/// Uploads a u8 NCHW batch (still u8 on the device).
fn upload_u8(img: &[u8], shape: [usize; 4], device: Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(img.to_vec(), shape.to_vec(), Device::Cpu)?.to_device(device)?)
}

/// u8 pixels to f32 in [0, 1].
fn to_unit_f32(u8_batch: &Tensor) -> Result<Tensor> {
    Ok(u8_batch.to_dtype(DType::F32)?.affine(1.0 / 255.0, 0.0)?)
}

/// Uploads a u8 NCHW batch and scales it to [0, 1] in f32.
pub fn images_to_tensor(img: &[u8], shape: [usize; 4], device: Device) -> Result<Tensor> {
    to_unit_f32(&upload_u8(img, shape, device)?)
}

/// u8 pixels (on the device) to f32 in [0, 1], with the HSV jitter applied on the device when
/// the loader left it there (one fused launch, byte-identical to the CPU path).
pub(crate) fn device_images(batch: &ptl_data::Batch, u8_batch: &Tensor) -> Result<Tensor> {
    let jittered = if batch.hsv_applied { u8_batch.clone() } else { hsv_on_device(batch, u8_batch)? };
    to_unit_f32(&jittered)
}

#[cfg(feature = "cuda")]
fn hsv_on_device(batch: &ptl_data::Batch, u8_batch: &Tensor) -> Result<Tensor> {
    Ok(ptl_data::device_hsv::apply_hsv_device(u8_batch, &batch.hsv_gains)?)
}

#[cfg(not(feature = "cuda"))]
fn hsv_on_device(batch: &ptl_data::Batch, u8_batch: &Tensor) -> Result<Tensor> {
    let [_, _, h, w] = batch.shape;
    let mut img: Vec<u8> = u8_batch.to_vec::<u8>()?;
    ptl_data::apply_hsv_batch_rgb_nchw(&mut img, h, w, &batch.hsv_gains);
    Ok(Tensor::from_vec(img, batch.shape.to_vec(), u8_batch.device())?)
}
