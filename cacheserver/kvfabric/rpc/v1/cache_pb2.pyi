from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_LOCAL_DISK: _ClassVar[Tier]
    TIER_SHARED: _ClassVar[Tier]
    TIER_OBJECT: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_LOCAL_DISK: Tier
TIER_SHARED: Tier
TIER_OBJECT: Tier

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched", "tiers", "describe")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    matched: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    describe: bool
    def __init__(self, matched: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., describe: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("namespace", "keys", "max_message_bytes", "batch_slots")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    batch_slots: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., batch_slots: _Optional[bool] = ...) -> None: ...

class LoadChunk(_message.Message):
    __slots__ = ("index", "total_length", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    total_length: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., total_length: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreChunk(_message.Message):
    __slots__ = ("namespace", "key", "total_length", "data")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    total_length: int
    data: bytes
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., total_length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("accepted", "dropped", "describe")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped: int
    describe: bool
    def __init__(self, accepted: _Optional[int] = ..., dropped: _Optional[int] = ..., describe: _Optional[bool] = ...) -> None: ...

class ShmSlot(_message.Message):
    __slots__ = ("name", "length", "more")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    name: str
    length: int
    more: _containers.RepeatedCompositeFieldContainer[ShmSlot]
    def __init__(self, name: _Optional[str] = ..., length: _Optional[int] = ..., more: _Optional[_Iterable[_Union[ShmSlot, _Mapping]]] = ...) -> None: ...

class ShmStoreBeginRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lengths")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ShmStoreBeginResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "dropped", "present", "describe")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    slots: _containers.RepeatedCompositeFieldContainer[ShmSlot]
    dropped: int
    present: int
    describe: bool
    def __init__(self, lease_id: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[ShmSlot, _Mapping]]] = ..., dropped: _Optional[int] = ..., present: _Optional[int] = ..., describe: _Optional[bool] = ...) -> None: ...

class ShmStoreCommitRequest(_message.Message):
    __slots__ = ("lease_id", "abort")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    abort: bool
    def __init__(self, lease_id: _Optional[str] = ..., abort: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyTiers(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("keys", "complete")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyTiers]
    complete: bool
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyTiers, _Mapping]]] = ..., complete: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("namespace", "spec_json")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    spec_json: str
    def __init__(self, namespace: _Optional[str] = ..., spec_json: _Optional[str] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
