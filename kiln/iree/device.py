"""An IREE device: opening it, what it can do, and moving arrays on and off it.

`IreeDevice.open("vulkan" | "local-task")` opens the driver's first device and reads its
capabilities from the driver's own report (`dump_device_info`): device type, the shader features
that decide the supported dtypes, subgroup size and memory. Names, vendor ids and driver strings
are kept for display only; nothing chooses by them.

Reading a device buffer back goes through a host-visible staging buffer the device allocates:
Vulkan drivers (Mesa's lavapipe among them) refuse to import an arbitrary host pointer, which is
what `DeviceArray.to_host()` tries first. Every upload and readback is counted, so the bytes a step
moves between host and device can be reported.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import weakref

import numpy as np

from kiln.errors import BackendUnavailable
from kiln.iree.vulkan_limits import max_storage_buffer_range

ROUTE_DRIVERS = {"vulkan": "vulkan", "iree-cpu": "local-task"}
ROUTE_TARGETS = {"vulkan": "vulkan-spirv", "iree-cpu": "llvm-cpu"}


def import_runtime():
    try:
        import iree.runtime as rt
    except ImportError as exc:
        raise BackendUnavailable(
            "the IREE runtime is not installed; install Kiln's vulkan extra: pip install 'kiln[vulkan]'") from exc
    return rt


@dataclasses.dataclass(frozen=True)
class DeviceCapabilities:
    """What a device can do, as its driver reports it. `name`, `vendor_id` and `driver` are for
    display (and `name` finds the device's buffer limit in the Vulkan loader): route selection never
    reads them."""

    route: str
    device_type: str  # "gpu", "cpu" (a CPU, or a software rasterizer), "other"
    dtypes: tuple[str, ...]  # among f32, f16, bf16, i8
    subgroup_size: int
    memory_bytes: int
    max_buffer_bytes: int  # the largest buffer a step may bind (Vulkan: maxStorageBufferRange, where known)
    name: str = ""
    vendor_id: str = ""
    driver: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def parse_device_info(route: str, info: str, memory_bytes: int = 0) -> DeviceCapabilities:
    """Capabilities from a driver's `dump_device_info` text (Vulkan prints features, subgroup and
    heaps; the CPU driver prints little, and the host's memory stands in)."""
    fields = dict(re.findall(r"^(\w[\w ]*?): (.*)$", info, re.MULTILINE))
    features = dict(re.findall(r"(\w+)=(yes|no)", fields.get("features", "")))
    heaps = [int(s) for s in re.findall(r"^\s*\[\d+\] size=(\d+)", info, re.MULTILINE)]
    subgroup = re.search(r"subgroup: size=(\d+)", info)
    if route == "iree-cpu":
        dtypes, device_type = ("f32", "f16", "bf16", "i8"), "cpu"
    else:
        dtypes = ("f32",) + tuple(name for name, feature in (("f16", "shaderFloat16"), ("bf16", "shaderBFloat16Type"),
                                                              ("i8", "shaderInt8")) if features.get(feature) == "yes")
        device_type = {"discrete-gpu": "gpu", "integrated-gpu": "gpu", "virtual-gpu": "gpu", "gpu": "gpu",
                       "cpu": "cpu"}.get(fields.get("type", ""), "other")
    memory = max(heaps, default=0) or memory_bytes
    return DeviceCapabilities(route=route, device_type=device_type, dtypes=dtypes,
                              subgroup_size=int(subgroup.group(1)) if subgroup else 1, memory_bytes=memory,
                              max_buffer_bytes=memory, name=fields.get("name", ""),
                              vendor_id=fields.get("vendor_id", ""), driver=fields.get("driver_info", ""))


def _host_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def probe(route: str) -> DeviceCapabilities:
    """The capabilities of a route's first device, read from its driver without opening it. Opening a
    device starts its driver's queue threads (lavapipe's poll without pause), so a probe that decides
    against the route must leave them unstarted."""
    rt = import_runtime()
    driver_name = ROUTE_DRIVERS[route]
    if driver_name not in rt.query_available_drivers():
        raise BackendUnavailable(f"route {route}: IREE has no {driver_name} driver in this build")
    try:
        driver = rt.get_driver(driver_name)
        found = driver.query_available_devices()
    except Exception as exc:  # the driver loads but finds no loader/ICD
        raise BackendUnavailable(f"route {route}: the {driver_name} driver cannot start ({exc}); "
                               + _install_hint(route)) from exc
    if not found:
        raise BackendUnavailable(f"route {route}: no {driver_name} device found; " + _install_hint(route))
    return parse_device_info(route, driver.dump_device_info(found[0]["device_id"]), _host_memory())


def with_buffer_limit(capabilities: DeviceCapabilities) -> DeviceCapabilities:
    """A Vulkan device's capabilities with its maxStorageBufferRange, which IREE's dump leaves out,
    read from the Vulkan loader. Read where the route opens, not in `probe`: an auto start on a CPU
    host probes Vulkan only to turn it down."""
    if capabilities.route != "vulkan" or not (limit := max_storage_buffer_range(capabilities.name)):
        return capabilities
    return dataclasses.replace(capabilities, max_buffer_bytes=min(capabilities.max_buffer_bytes, limit))


class IreeDevice:
    """One opened IREE device with its runtime configuration."""

    def __init__(self, route: str):
        self.capabilities = with_buffer_limit(probe(route))
        self.rt = import_runtime()
        self.route = route
        self.driver_name = ROUTE_DRIVERS[route]
        # an uncached device: it closes, and its driver threads stop, once this object and its modules go
        self.device = self.rt.get_driver(self.driver_name).create_device_by_uri(self.driver_name)
        self.config = self.rt.Config(device=self.device)
        self._lock = threading.Lock()
        self.uploaded_bytes = 0  # host -> device, all time
        self.downloaded_bytes = 0  # device -> host, all time

    def upload(self, array: np.ndarray):
        array = np.ascontiguousarray(array)
        with self._lock:
            self.uploaded_bytes += array.nbytes
        return self.rt.asdevicearray(self.device, array)

    def to_host(self, array) -> np.ndarray:
        """A device array's contents, copied through a staging buffer the device allocated."""
        rt = self.rt
        view = array._buffer_view
        dtype = rt.HalElementType.map_to_dtype(view.element_type)
        shape = tuple(view.shape)
        with self._lock:
            self.downloaded_bytes += view.byte_length
        if view.byte_length == 0:
            return np.zeros(shape, dtype)
        source = view.get_buffer()
        staging = self.device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
            allocation_size=source.byte_length())
        semaphore = self.device.create_semaphore(0)
        self.device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(semaphore, 0),
                               signal_semaphores=rt.HalFence.create_at(semaphore, 1))
        rt.HalFence.create_at(semaphore, 1).wait()
        return np.array(staging.map().asarray(shape, dtype), copy=True)

    def load(self, vmfb: bytes) -> LoadedModule:
        """A compiled module's `main` function (exported modules are named jit_<fn>)."""
        module = self.rt.VmModule.copy_buffer(self.config.vm_instance, vmfb)
        context = self.rt.SystemContext(config=self.config)
        context.add_vm_module(module)
        return LoadedModule(context, context.modules[module.name]["main"])


class LoadedModule:
    """A module's entry point with the context it lives in: the function does not keep its
    context alive, and calling it after the context is collected crashes the process."""

    def __init__(self, context, function):
        self.context, self.function = context, function

    def __call__(self, *args):
        return self.function(*args)


def _install_hint(route: str) -> str:
    if route == "vulkan":
        return ("install a Vulkan driver and loader (for a software device: apt-get install mesa-vulkan-drivers "
                "libvulkan1)")
    return "reinstall Kiln's vulkan extra: pip install 'kiln[vulkan]'"


_open_devices: weakref.WeakValueDictionary[str, IreeDevice] = weakref.WeakValueDictionary()
_open_lock = threading.Lock()


def open_device(route: str) -> IreeDevice:
    """The route's device open in this process, opened if none is. One at a time: a second lavapipe
    device beside an open one lost its queue (VK_ERROR_DEVICE_LOST). Unlike IREE's own device cache,
    the device closes once no route uses it."""
    with _open_lock:
        device = _open_devices.get(route)
        if device is None:
            device = _open_devices[route] = IreeDevice(route)
        return device
