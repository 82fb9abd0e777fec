"""The one Vulkan device limit Kiln needs that IREE's device dump leaves out: the largest range a
shader may bind as one storage buffer (`maxStorageBufferRange`).

A module that binds a larger buffer, such as a KV pool of the host's size, fails on the device
rather than at compile time: on lavapipe (128 MiB, the least the Vulkan spec allows) it ended the
start with "transient buffer has no staged Vulkan backing" and then a lost device. The limit is read
from the Vulkan loader through ctypes: an instance is created and destroyed, and no device is
opened (an open lavapipe device starts polling threads). Any failure reads as unknown (None).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct

_INSTANCE_CREATE_INFO = 1  # VkStructureType
_PROPERTIES_BYTES = 1024  # VkPhysicalDeviceProperties is 824 bytes on 64-bit ABIs
_NAME = slice(20, 276)  # deviceName[256], after five uint32 fields
# VkPhysicalDeviceLimits starts at byte 296 (8-aligned after the 16-byte pipeline cache UUID);
# maxStorageBufferRange is its eighth uint32
_MAX_STORAGE_BUFFER_RANGE = 296 + 7 * 4


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


def max_storage_buffer_range(device_name: str) -> int | None:
    """The named physical device's maxStorageBufferRange in bytes, or None where the loader, the
    device or the call is missing."""
    try:
        vk = ctypes.CDLL(ctypes.util.find_library("vulkan") or "libvulkan.so.1")
    except OSError:
        return None
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(_InstanceCreateInfo(_INSTANCE_CREATE_INFO)), None,
                           ctypes.byref(instance)) != 0:
        return None
    try:
        count = ctypes.c_uint32(0)
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != 0 or not count.value:
            return None
        devices = (ctypes.c_void_p * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devices) not in (0, 5):  # 5: VK_INCOMPLETE
            return None
        for device in devices[: count.value]:
            properties = (ctypes.c_ubyte * _PROPERTIES_BYTES)()
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(device), properties)
            raw = bytes(properties)
            if raw[_NAME].split(b"\0")[0].decode(errors="replace") == device_name:
                return struct.unpack_from("<I", raw, _MAX_STORAGE_BUFFER_RANGE)[0]
        return None
    finally:
        vk.vkDestroyInstance(instance, None)
